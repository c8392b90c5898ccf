import os
import warnings
from collections import Counter

import numpy as np
import pandas as pd
import pytest
from PIL import Image
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from common.data import chestxray, synthetic
from common.measure import metrics
from common.run.params import FINDINGS

NIH_HEADER = (
    "Image Index,Finding Labels,Follow-up #,Patient ID,Patient Age,Patient Gender,View Position,"
    "OriginalImage[Width,Height],OriginalImagePixelSpacing[x,y],"
)


def test_same_seed_gives_identical_files(tmp_path):
    first = synthetic.generate(tmp_path / "a", n_images=40, image_size=32, seed=7)
    second = synthetic.generate(tmp_path / "b", n_images=40, image_size=32, seed=7)
    for name in (chestxray.CSV_NAME, chestxray.TEST_LIST, chestxray.TRAIN_VAL_LIST):
        assert (first / name).read_bytes() == (second / name).read_bytes()
    for image in ("00000001_000.png", "00000002_000.png", sorted(os.listdir(first / "images"))[-1]):
        assert (first / "images" / image).read_bytes() == (second / "images" / image).read_bytes()


def test_different_seed_gives_different_labels_and_pixels(tmp_path):
    assert not synthetic.labels_for(200, 0)["Finding Labels"].equals(synthetic.labels_for(200, 1)["Finding Labels"])
    a = synthetic.generate(tmp_path / "a", n_images=5, image_size=32, seed=0)
    b = synthetic.generate(tmp_path / "b", n_images=5, image_size=32, seed=1)
    assert (a / "images" / "00000001_000.png").read_bytes() != (b / "images" / "00000001_000.png").read_bytes()


def test_csv_header_is_exactly_the_nih_header(standin):
    lines = (standin / chestxray.CSV_NAME).read_text().splitlines()
    assert lines[0] == NIH_HEADER
    assert len(lines) == 121
    assert all(line.endswith(",") for line in lines)  # NIH ends every line with a comma


def test_layout_matches_the_nih_release(standin):
    assert (standin / synthetic.COMPLETE_MARKER).is_file()
    images = sorted(os.listdir(standin / "images"))
    entries = pd.read_csv(standin / chestxray.CSV_NAME)
    assert images == sorted(entries["Image Index"])
    test = (standin / chestxray.TEST_LIST).read_text().split()
    train_val = (standin / chestxray.TRAIN_VAL_LIST).read_text().split()
    assert sorted(test + train_val) == images


def test_several_images_per_patient():
    entries = synthetic.labels_for(500, seed=0)
    per_patient = entries.groupby("Patient ID").size()
    assert per_patient.max() > 1
    assert per_patient.mean() > 1.5
    assert per_patient.max() <= 6
    assert all(name.startswith(f"{pid:08d}_") for name, pid in zip(entries["Image Index"], entries["Patient ID"]))


def test_no_finding_is_the_most_common_label_and_every_finding_occurs():
    entries = synthetic.labels_for(2000, seed=0)
    assert len(entries) == 2000
    assert entries["Finding Labels"].value_counts().index[0] == "No Finding"
    counts = Counter(label for cell in entries["Finding Labels"] for label in cell.split("|"))
    assert counts.most_common(1)[0][0] == "No Finding"
    assert set(counts) == set(FINDINGS) | {"No Finding"}


def test_images_are_grayscale_of_the_requested_size(tmp_path):
    folder = synthetic.generate(tmp_path / "x", n_images=10, image_size=24, seed=0)
    for name in os.listdir(folder / "images"):
        with Image.open(folder / "images" / name) as image:
            assert image.mode == "L"
            assert image.size == (24, 24)
    entries = pd.read_csv(folder / chestxray.CSV_NAME)
    assert (entries["OriginalImage[Width"] == 24).all()


def _features(path) -> np.ndarray:
    """Position-free features: histograms of brightness and of horizontal/vertical gradients."""
    pixels = np.asarray(Image.open(path), dtype=np.float32) / 255

    def histogram(values, bins):
        return np.histogram(values, bins=bins, range=(0, 1))[0] / values.size

    return np.concatenate(
        [
            histogram(pixels, 16),
            histogram(np.abs(np.diff(pixels, axis=1)), 8),
            histogram(np.abs(np.diff(pixels, axis=0)), 8),
        ]
    )


def _mean_test_auc(splits, shuffle_labels: bool) -> float:
    train_paths = splits["train"].paths + splits["valid"].paths
    train_labels = np.vstack([splits["train"].labels, splits["valid"].labels])
    if shuffle_labels:
        train_labels = np.random.default_rng(0).permutation(train_labels)
    x_train = np.stack([_features(p) for p in train_paths])
    x_test = np.stack([_features(p) for p in splits["test"].paths])
    scores = np.zeros_like(splits["test"].labels)
    for k in range(len(FINDINGS)):
        if np.unique(train_labels[:, k]).size == 2:
            model = make_pipeline(StandardScaler(), LogisticRegression(C=0.1, max_iter=2000))
            scores[:, k] = model.fit(x_train, train_labels[:, k]).decision_function(x_test)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rare findings may have no positive in a small test split
        return metrics.roc_auc(splits["test"].labels, scores).mean


@pytest.fixture(scope="module")
def splits_400(tmp_path_factory):
    folder = synthetic.generate(tmp_path_factory.mktemp("learn") / "x", n_images=400, image_size=32, seed=0)
    return chestxray.load(folder, seed=0)


# Observed with these features: 0.84 for seed 0 (0.68-0.86 over seeds 0-7); shuffled labels give 0.37-0.54.
LEARNABLE_BAR = 0.65


def test_findings_are_learnable_without_deep_learning(splits_400):
    assert _mean_test_auc(splits_400, shuffle_labels=False) > LEARNABLE_BAR


def test_shuffled_labels_are_not_learnable_control(splits_400):
    assert _mean_test_auc(splits_400, shuffle_labels=True) < LEARNABLE_BAR


# --- cache and atomic writes ---------------------------------------------------------


def test_ensure_generates_once_under_chestxray_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CHESTXRAY_CACHE", str(tmp_path / "cache"))
    folder = synthetic.ensure(n_images=12, image_size=16, seed=5)
    assert folder == tmp_path / "cache" / "chestxray-synthetic-n12-px16-seed5"
    assert (folder / synthetic.COMPLETE_MARKER).is_file()

    def must_not_generate(*args, **kwargs):
        raise AssertionError("ensure() regenerated a cached data set")

    monkeypatch.setattr(synthetic, "generate", must_not_generate)
    assert synthetic.ensure(n_images=12, image_size=16, seed=5) == folder


def test_cache_root_prefers_chestxray_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CHESTXRAY_CACHE", str(tmp_path / "here"))
    assert synthetic.cache_root() == tmp_path / "here"
    monkeypatch.delenv("CHESTXRAY_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert synthetic.cache_root() == tmp_path / "xdg" / "multigpu-notebooks"


def test_ensure_regenerates_a_folder_without_the_complete_marker(tmp_path):
    stale = tmp_path / "chestxray-synthetic-n12-px16-seed0"
    (stale / "images").mkdir(parents=True)
    (stale / "leftover.txt").write_text("old")
    folder = synthetic.ensure(n_images=12, image_size=16, seed=0, root=tmp_path)
    assert folder == stale
    assert (folder / synthetic.COMPLETE_MARKER).is_file()
    assert not (folder / "leftover.txt").exists()
    assert len(os.listdir(folder / "images")) == 12


def test_generate_leaves_nothing_behind_when_it_fails(tmp_path, monkeypatch):
    real_render, calls = synthetic.render, []

    def failing_render(*args, **kwargs):
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("disk full")
        return real_render(*args, **kwargs)

    monkeypatch.setattr(synthetic, "render", failing_render)
    parent = tmp_path / "parent"
    with pytest.raises(RuntimeError, match="disk full"):
        synthetic.generate(parent / "x", n_images=20, image_size=16, seed=0)
    assert len(calls) == 4  # it did fail part-way, after writing images
    assert not (parent / "x").exists()
    assert os.listdir(parent) == []  # no temporary folder either
