import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from common.data import chestxray
from common.errors import InputError
from common.run.params import FINDINGS


def names(split):
    return {Path(p).name for p in split.paths}


def patients(split):
    return set(split.patients.tolist())


def assert_patient_disjoint(splits):
    train, valid, test = (patients(splits[name]) for name in ("train", "valid", "test"))
    assert not train & valid
    assert not train & test
    assert not valid & test


# --- labels ------------------------------------------------------------------------


def test_multi_hot_no_finding_is_all_zeros():
    out = chestxray.multi_hot(pd.Series(["No Finding"]))
    assert out.shape == (1, len(FINDINGS))
    assert not out.any()


def test_multi_hot_sets_one_per_finding_in_the_fixed_order():
    out = chestxray.multi_hot(pd.Series(["Effusion|Mass", "Atelectasis", "Hernia"]))
    assert out.dtype == np.float32
    assert np.flatnonzero(out[0]).tolist() == [FINDINGS.index("Effusion"), FINDINGS.index("Mass")] == [2, 4]
    assert np.flatnonzero(out[1]).tolist() == [0]
    assert np.flatnonzero(out[2]).tolist() == [13]
    assert out.sum() == 4


# --- load -------------------------------------------------------------------------


def test_load_returns_three_patient_disjoint_splits(standin):
    splits = chestxray.load(standin)
    assert list(splits) == ["train", "valid", "test"]
    assert all(len(split) > 0 for split in splits.values())
    assert sum(len(split) for split in splits.values()) == 120
    for split in splits.values():
        assert split.labels.shape == (len(split), len(FINDINGS))
        assert len(split.patients) == len(split)
    assert_patient_disjoint(splits)


def test_load_labels_match_the_csv(standin):
    entries = pd.read_csv(standin / chestxray.CSV_NAME).set_index("Image Index")
    split = chestxray.load(standin)["train"]
    for path, row in zip(split.paths[:20], split.labels[:20]):
        expected = chestxray.multi_hot(pd.Series([entries.loc[Path(path).name, "Finding Labels"]]))[0]
        assert np.array_equal(row, expected)


def test_test_split_is_exactly_the_official_test_list(standin):
    official = set((standin / chestxray.TEST_LIST).read_text().split())
    splits = chestxray.load(standin)
    assert names(splits["test"]) == official
    assert not (names(splits["train"]) | names(splits["valid"])) & official


def test_without_official_lists_a_seeded_patient_split_is_used(standin_copy):
    official = set((standin_copy / chestxray.TEST_LIST).read_text().split())
    (standin_copy / chestxray.TEST_LIST).unlink()
    (standin_copy / chestxray.TRAIN_VAL_LIST).unlink()
    first = chestxray.load(standin_copy, seed=3)
    again = chestxray.load(standin_copy, seed=3)
    other = chestxray.load(standin_copy, seed=4)
    assert_patient_disjoint(first)
    for name in chestxray.SPLIT_NAMES:
        assert first[name].paths == again[name].paths
    assert names(first["test"]) != official  # not the official list
    assert names(first["test"]) != names(other["test"])  # the seed matters


def test_assign_splits_reports_which_split_it_used(standin_copy):
    entries = chestxray.read_entries(standin_copy)
    assert chestxray.assign_splits(entries, standin_copy, seed=0)[1] == "official lists"
    (standin_copy / chestxray.TEST_LIST).unlink()
    assert chestxray.assign_splits(entries, standin_copy, seed=0)[1].startswith("seeded patient split")


def test_subsample_patients_keeps_whole_patients_and_at_most_max_images(standin):
    entries = chestxray.read_entries(standin)
    sizes = entries.groupby("Patient ID").size()
    for max_images in (10, 37, 60):
        kept = chestxray.subsample_patients(entries, max_images, seed=1)
        assert 0 < len(kept) <= max_images
        kept_sizes = kept.groupby("Patient ID").size()
        assert kept_sizes.equals(sizes.loc[kept_sizes.index])  # every kept patient is complete


def test_subsample_patients_keeps_everything_without_a_limit(standin):
    entries = chestxray.read_entries(standin)
    assert len(chestxray.subsample_patients(entries, None, seed=0)) == len(entries)
    assert len(chestxray.subsample_patients(entries, 10_000, seed=0)) == len(entries)


def test_load_with_max_images_uses_a_subset(standin):
    splits = chestxray.load(standin, max_images=80)
    assert sum(len(split) for split in splits.values()) <= 80
    assert_patient_disjoint(splits)


def test_images_are_found_in_nested_archive_folders(standin_copy):
    nested = standin_copy / "images_001" / "images"
    nested.parent.mkdir()
    shutil.move(standin_copy / "images", nested)
    splits = chestxray.load(standin_copy)
    assert sum(len(split) for split in splits.values()) == 120
    assert all(Path(p).parent == nested for split in splits.values() for p in split.paths)


# --- errors a user must fix ----------------------------------------------------------


def test_missing_data_folder(tmp_path):
    with pytest.raises(InputError, match=r"nowhere does not exist: set DATA_DIR .* or to None"):
        chestxray.load(tmp_path / "nowhere")


def test_missing_csv(standin_copy):
    (standin_copy / chestxray.CSV_NAME).unlink()
    with pytest.raises(InputError, match=r"Data_Entry_2017\.csv is missing: DATA_DIR must contain"):
        chestxray.load(standin_copy)


def test_csv_missing_a_required_column(standin_copy):
    csv = standin_copy / chestxray.CSV_NAME
    pd.read_csv(csv).drop(columns=["Patient ID"]).to_csv(csv, index=False)
    with pytest.raises(InputError, match=r"lacks the column\(s\) 'Patient ID'.*use the unmodified Data_Entry_2017"):
        chestxray.load(standin_copy)


def test_unknown_finding_label(standin_copy):
    csv = standin_copy / chestxray.CSV_NAME
    entries = pd.read_csv(csv)
    entries.loc[5, "Finding Labels"] = "Effusion|Pneumonitis"
    entries.to_csv(csv, index=False)
    bad_image = entries.loc[5, "Image Index"]
    with pytest.raises(InputError, match=r"unknown finding label\(s\) 'Pneumonitis'") as caught:
        chestxray.load(standin_copy)
    assert bad_image in str(caught.value)
    assert "Fix the spelling or drop those rows" in str(caught.value)


def test_image_listed_but_missing(standin_copy):
    (standin_copy / "images" / "00000002_000.png").unlink()
    with pytest.raises(InputError, match=r"1 image\(s\) listed .* \(first: 00000002_000\.png\): extract all"):
        chestxray.load(standin_copy)


def test_unreadable_image_is_named(standin_copy):
    (standin_copy / "images" / "00000003_001.png").write_bytes(b"this is not a png" * 10)
    with pytest.raises(InputError, match=r"Cannot read image .*00000003_001\.png.*Replace it from the NIH release"):
        chestxray.load(standin_copy)


def test_truncated_image_is_named(standin_copy):
    path = standin_copy / "images" / "00000004_000.png"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with Image.open(path) as image:  # the header still reads: only a full decode finds the damage
        assert image.size == (32, 32)
    with pytest.raises(InputError, match=r"Cannot read image .*00000004_000\.png.*damaged or truncated"):
        chestxray.load(standin_copy)


def test_check_false_skips_decoding(standin_copy):
    (standin_copy / "images" / "00000003_001.png").write_bytes(b"garbage")
    splits = chestxray.load(standin_copy, check=False)
    assert sum(len(split) for split in splits.values()) == 120


def test_describe_counts_images_and_patients_then_each_findings_prevalence_per_split(standin):
    splits = chestxray.load(standin)
    table = chestxray.describe(splits)
    assert list(table.columns) == list(chestxray.SPLIT_NAMES)
    assert list(table.index) == ["images", "patients", *(f"{finding} %" for finding in FINDINGS)]
    assert table.loc["images"].tolist() == [len(splits[name]) for name in chestxray.SPLIT_NAMES]
    assert table.loc["patients", "test"] == len(patients(splits["test"]))
    assert table.loc["Mass %", "train"] == round(100 * splits["train"].prevalence()["Mass"], 1)


def test_describe_keeps_counts_whole_after_the_notebooks_round(standin):
    shown = chestxray.describe(chestxray.load(standin)).round(3).to_string()
    counts = [line.split()[1:] for line in shown.splitlines() if line.startswith(("images", "patients"))]
    assert len(counts) == 2 and all(value.isdigit() for row in counts for value in row), shown
    assert max(len(line) for line in shown.splitlines()) < 50, "narrow: no wrapping, no scrolling"


def test_describe_shows_the_training_steps_per_epoch_and_refuses_less_than_one(standin):
    """Every training notebook's Data cell describes its splits with its global batch: a run that would take no step
    (check.sh once ran 840 images at 4 GPUs x 256) stops there, before any training."""
    splits = chestxray.load(standin)
    table = chestxray.describe(splits, 16, 2).round(3)
    assert table.loc["steps of 16 images"].tolist() == [len(splits["train"]) // 16, "", ""]
    with pytest.raises(InputError, match=f"holds {len(splits['train'])} images, fewer than one global batch of 1024"):
        chestxray.describe(splits, 1024, 4)
