"""The loss-placement notebook, executed once by nbval on 2 simulated CPU devices; its records are then checked.

Without GPUs only DDP can run; the DataParallel ways must be refused when asked for and named as not measured.
"""

import pytest
from notebook_harness import AUC_BAR, BAD_INPUT, check_training_record, marks, refusals, run_nbval

from common.measure import results

NOTEBOOK = "PyTorch_MultiGPU-Exp-Loss"
pytestmark = marks(NOTEBOOK)
TINY = dict(DEVICES=2, EPOCHS=2, IMAGE_SIZE=64, BATCH_SIZE_PER_DEVICE=16, BENCH_STEPS=2)


@pytest.fixture(scope="module")
def records(notebook_data, tmp_path_factory):
    """nbval executes the notebook (checking every cell runs) and leaves its records behind: one run serves both."""
    out = tmp_path_factory.mktemp("exp-loss")
    run_nbval(NOTEBOOK, notebook_data, out, **TINY)
    return {record["data"]: record for record in results.load_all(out / "results")}


def test_ddp_trains_and_is_recorded_as_the_one_way_run(records):
    assert set(records) == {"generated", results.IN_RAM}
    trained = records["generated"]
    check_training_record(trained, framework="pytorch", notebook=NOTEBOOK, devices=2, parameters=TINY)
    assert {record["variant"] for record in records.values()} == {"ddp"}
    assert trained["test_auc"] > AUC_BAR
    assert len(trained["train_loss"]) == TINY["EPOCHS"] and trained["train_loss"][-1] < trained["train_loss"][0]
    assert records[results.IN_RAM]["images_per_second"] > 0


def test_what_needs_gpus_is_recorded_as_not_measured(records):
    for record in records.values():
        assert "dp-gather and dp-replica-loss" in record["not_measured"]
        assert "2 or more GPUs" in record["not_measured"]["dp-gather and dp-replica-loss"]
        assert "peak memory per device and imbalance" in record["not_measured"]
        assert record["peak_memory_mib_per_device"] == {} and record["memory_imbalance"] is None


def test_loss_in_each_replica_gives_the_gathered_loss_and_gradients(records):
    check = records["generated"]["replica_loss_check"]
    assert check["shares"] == 2
    # a small slice, not the global batch: two graphs of a GPU's global batch would need tens of GiB of RAM
    assert check["images"] == 2 * check["shares"] < TINY["DEVICES"] * TINY["BATCH_SIZE_PER_DEVICE"]
    assert check["loss_difference"] < 1e-6
    assert check["gradient_max"] > 0 and check["gradient_max_difference"] <= 1e-4 * check["gradient_max"]


REFUSALS = {
    "data-parallel-without-gpus": ({"WAYS": ["dp-gather"]}, "needs 2 or more GPUs"),
    "unknown-way": ({"WAYS": ["ddp", "pipeline"]}, "unknown way(s) pipeline"),
    "too-many-devices": BAD_INPUT["too-many-devices"],
    "fewer-than-one-batch": BAD_INPUT["fewer-than-one-batch"],
}


@pytest.fixture(scope="module")
def refused(notebook_data, tmp_path_factory):
    return refusals(NOTEBOOK, notebook_data, tmp_path_factory.mktemp("refusals"), REFUSALS)


@pytest.mark.parametrize("case", list(REFUSALS))
def test_bad_input_stops_before_training(refused, case):
    if refused[case] is not None:
        raise refused[case]
