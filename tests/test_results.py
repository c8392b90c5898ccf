import json
import os

import pandas as pd
import pytest
from records import complete_record

from common.errors import InputError
from common.measure import metrics, results
from common.measure.phases import Phases
from common.run import devices, params, protocol


def test_new_record_fills_run_id_commit_and_timestamp():
    record = complete_record()
    assert len(record["run_id"]) == 12
    assert "timestamp" in record and "git_commit" in record
    assert results.validate(record) is record


def test_record_round_trips_through_write_and_load_all(tmp_path):
    record = complete_record()
    path = results.write(record, tmp_path)
    assert path.name == f"PyTorch_MultiGPU-2dev-generated-{record['run_id']}.json"
    (loaded,) = results.load_all(tmp_path)
    assert loaded.pop("path") == str(path)
    assert loaded == record


def test_load_all_returns_oldest_first(tmp_path):
    newer = complete_record(timestamp="2025-02-01T00:00:00+00:00", run_id="bbbb")
    older = complete_record(timestamp="2025-01-01T00:00:00+00:00", run_id="zzzz")
    results.write(newer, tmp_path)
    results.write(older, tmp_path)
    assert [r["run_id"] for r in results.load_all(tmp_path)] == ["zzzz", "bbbb"]


def test_write_leaves_no_temp_files(tmp_path):
    results.write(complete_record(), tmp_path)
    files = os.listdir(tmp_path)
    assert len(files) == 1
    assert not [name for name in files if name.startswith(".")]


def test_write_with_utilization_writes_the_csv_and_records_its_name(tmp_path):
    frame = pd.DataFrame(
        {
            "seconds": [0.0, 0.5],
            "device": ["cpu", "cpu"],
            "utilization_percent": [50.0, 70.0],
            "memory_mib": [10.0, 12.0],
        }
    )
    path = results.write(complete_record(), tmp_path, utilization=frame)
    saved = json.loads(path.read_text())
    csv = tmp_path / saved["utilization_csv"]
    assert csv.name == path.name.replace(".json", ".utilization.csv")
    pd.testing.assert_frame_equal(pd.read_csv(csv), frame)
    assert sorted(os.listdir(tmp_path)) == sorted([path.name, csv.name])


def test_write_turns_numpy_values_into_json(tmp_path):
    import numpy as np

    record = complete_record(train_images=np.int64(700), epoch_seconds=np.array([1.5, 2.0]), test_auc=np.float32(0.5))
    (loaded,) = results.load_all(results.write(record, tmp_path).parent)
    assert (loaded["train_images"], loaded["epoch_seconds"], loaded["test_auc"]) == (700, [1.5, 2.0], 0.5)


@pytest.mark.parametrize("field", ["framework", "test_auc", "timestamp", "device_utilization"])
def test_validate_rejects_missing_fields(field):
    record = complete_record()
    del record[field]
    with pytest.raises(ValueError, match=f"results record lacks {field}"):
        results.validate(record)


def test_validate_names_every_missing_field():
    with pytest.raises(ValueError, match="lacks framework, notebook, devices"):
        results.validate({})


@pytest.mark.parametrize("data", ["synthetic", "Real", None])
def test_validate_rejects_bad_data_kinds(data):
    with pytest.raises(ValueError, match="data must be one of"):
        results.validate(complete_record(data=data))


def test_validate_rejects_bad_device_kinds():
    with pytest.raises(ValueError, match="device_kind must be 'gpu' or 'cpu'"):
        results.validate(complete_record(device_kind="tpu"))


def test_write_refuses_an_invalid_record_before_writing(tmp_path):
    with pytest.raises(ValueError):
        results.write(complete_record(data="made-up"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_load_all_rejects_a_damaged_record(tmp_path):
    (tmp_path / "bad.json").write_text(json.dumps({"framework": "jax"}))
    with pytest.raises(ValueError, match="lacks"):
        results.load_all(tmp_path)


def test_check_writable_creates_the_folder(tmp_path):
    folder = tmp_path / "a" / "b"
    assert results.check_writable(folder) == folder
    assert folder.is_dir()
    assert os.listdir(folder) == []  # the write test left nothing


def test_check_writable_names_the_folder_and_the_fix(tmp_path):
    (tmp_path / "afile").write_text("a regular file, not a folder")
    folder = tmp_path / "afile" / "sub"
    with pytest.raises(InputError, match=r"RESULTS_DIR .*afile/sub is not writable .*choose a folder you can write to"):
        results.check_writable(folder)


def test_interrupted_write_leaves_no_file_and_no_temp_file(tmp_path, monkeypatch):
    """Interrupted after the temporary file is written, before the rename: nothing is left behind."""

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(results.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        results.write(complete_record(), tmp_path)
    assert os.listdir(tmp_path) == []


def test_versions_reports_python_and_missing_packages():
    found = results.versions("pandas", "surely-not-an-installed-package")
    assert found["python"].count(".") == 2
    assert found["pandas"] == pd.__version__
    assert found["surely-not-an-installed-package"] is None


def test_written_files_are_readable_by_others_as_umask_allows(tmp_path):
    previous = os.umask(0o022)
    try:
        path = results.write(complete_record(), tmp_path)
    finally:
        os.umask(previous)
    assert path.stat().st_mode & 0o777 == 0o644


def test_atomic_write_keeps_the_mode_of_a_file_it_replaces(tmp_path):
    path = tmp_path / "README.md"
    path.write_text("old")
    path.chmod(0o640)
    results.atomic_write(path, lambda file: file.write("new"))
    assert path.read_text() == "new" and path.stat().st_mode & 0o777 == 0o640


class Watched:
    """What a Monitor gives a record: a summary, its samples and when it started."""

    started = 1000.0

    def summary(self):
        return {"cpu": {"utilization_mean_percent": 90.0, "memory_peak_mib": 10.0}}

    def frame(self):
        return pd.DataFrame({"seconds": [0.0], "device": ["cpu"], "utilization_percent": [90.0], "memory_mib": [10.0]})


def test_a_runs_two_records_share_its_fields_and_are_complete(tmp_path):
    hardware = devices.resolve(2, gpus=[], cores=2)
    cfg = params.fill(hardware, EPOCHS=2, BATCH_SIZE_PER_DEVICE=16, IMAGE_SIZE=64)
    run = results.Run(
        "pytorch",
        "PyTorch_MultiGPU",
        hardware,
        cfg,
        devices=2,
        global_batch=32,
        learning_rate=2e-3,
        packages=("torch",),
        compile=False,
    )
    history = {
        **protocol.new_history(train_images=100, images_per_epoch=96),
        "epoch_seconds": [4.0, 2.0],
        "train_loss": [0.5, 0.3],
        "valid_auc": [0.6, 0.7],
        "data_wait_seconds": [0.1, 0.0],
    }
    auc = metrics.AUC({"Mass": 0.8}, 0.8)
    phases = Phases()
    phases.add("train", 1000.0, 1004.0, 1)
    trained, benchmarked = run.training("generated", history, auc, Watched(), phases), run.benchmark(50.0, Watched())
    for record in (trained, benchmarked):
        results.validate(record.fields)
        assert record.fields["learning_rate"] == 2e-3 and record.fields["compile"] is False
        assert record.fields["batch_size_per_device"] == 16 and record.fields["prepared_size"] == 73
        assert record.fields["precision"] == "fp32" and record.fields["image_size"] == 64
        assert record.fields["utilization_started"] == 1000.0 and len(record.utilization) == 1
    assert trained.fields["images_per_second"] == 48.0  # the first epoch left out
    assert trained.fields["phases"] == phases.rows() and trained.fields["data_wait_seconds"] == [0.1, 0.0]
    decoded = results.Run("pytorch", "PyTorch_MultiGPU", hardware, {**cfg, "PREPARED": False}, devices=2,
                          global_batch=32, learning_rate=2e-3)  # fmt: skip
    assert decoded.fields["prepared_size"] is None, "a run that decoded the PNGs says so"
    assert benchmarked.fields["data"] == results.IN_RAM and benchmarked.fields["epochs"] == 0
    # a variant that used fewer devices says so in its own record
    assert run.benchmark(50.0, Watched(), devices=1, variant="single").fields["devices"] == 1
    assert len(results.write_all([trained, benchmarked], tmp_path)) == 2
    assert results.write_all([trained], tmp_path / "other", chief=False, who="worker 1") == []
    assert not (tmp_path / "other").exists()
