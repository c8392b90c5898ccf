"""The PyTorch reference notebook, executed headless with papermill on 1 and 2 simulated CPU devices."""

import pytest
from notebook_harness import (
    AUC_BAR,
    AUC_GAP,
    assert_stops_before_training,
    check_training_record,
    records_by_devices,
    run_nbval,
)

NOTEBOOK = "PyTorch_MultiGPU"
TINY = dict(EPOCHS=3, IMAGE_SIZE=64, BATCH_SIZE_PER_DEVICE=16, BENCH_STEPS=2)


@pytest.fixture(scope="module")
def runs(notebook_data, tmp_path_factory):
    return records_by_devices(NOTEBOOK, notebook_data, tmp_path_factory.mktemp("runs"), **TINY)


@pytest.mark.parametrize("devices", [1, 2])
def test_records_are_complete(runs, devices):
    assert set(runs[devices]) == {"generated", "synthetic-in-RAM"}
    check_training_record(
        runs[devices]["generated"], framework="pytorch", notebook=NOTEBOOK, devices=devices, parameters=TINY
    )
    assert runs[devices]["synthetic-in-RAM"]["images_per_second"] > 0


@pytest.mark.parametrize("devices", [1, 2])
def test_learns_above_the_bar(runs, devices):
    assert runs[devices]["generated"]["test_auc"] > AUC_BAR


def test_one_and_two_devices_reach_the_same_auc(runs):
    auc1, auc2 = (runs[d]["generated"]["test_auc"] for d in (1, 2))
    assert abs(auc1 - auc2) < AUC_GAP, f"1 device: {auc1:.3f}, 2 devices: {auc2:.3f}"


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"DEVICES": 64}, "DEVICES=64 but"),
        ({"DATA_DIR": "/nonexistent/chestxray"}, "does not exist"),
        ({"BATCH_SIZE_PER_DEVICE": 0}, "BATCH_SIZE_PER_DEVICE must be a positive integer"),
        ({"PRECISION": "fp8"}, "PRECISION must be"),
    ],
    ids=["too-many-devices", "missing-data", "zero-batch", "bad-precision"],
)
def test_bad_input_stops_before_training(notebook_data, tmp_path, parameters, message):
    assert_stops_before_training(NOTEBOOK, notebook_data, tmp_path, parameters, message)


def test_nbval(notebook_data, tmp_path):
    run_nbval(NOTEBOOK, notebook_data, tmp_path)
