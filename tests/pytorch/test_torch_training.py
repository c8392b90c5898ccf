"""The shared pieces of the PyTorch experiment notebooks: which placements a machine can measure, the timing helper."""

import pytest

from common.errors import InputError
from common.pytorch import training as tt
from common.run import devices

FOUR_GPUS = devices.resolve(None, gpus=["NVIDIA H100"] * 4)
ONE_GPU = devices.resolve(None, gpus=["NVIDIA H100"])
CPU = devices.resolve(2, gpus=[], cores=2)


def test_all_placements_on_several_gpus_and_nothing_left_unmeasured():
    assert tt.choose_placements(None, FOUR_GPUS) == (["dp-gather", "dp-replica-loss", "ddp"], {})


@pytest.mark.parametrize("hardware", [ONE_GPU, CPU], ids=["one-gpu", "cpu"])
def test_only_ddp_without_several_gpus_and_data_parallel_named_as_not_measured(hardware):
    ways, not_measured = tt.choose_placements(None, hardware)
    assert ways == ["ddp"]
    assert "2 or more GPUs" in not_measured["dp-gather and dp-replica-loss"]
    assert ("peak memory per device and imbalance" in not_measured) == (hardware.kind == "cpu")


def test_a_requested_subset_runs_in_a_fixed_order_and_the_rest_is_named():
    ways, not_measured = tt.choose_placements(["ddp", "dp-gather"], FOUR_GPUS)
    assert ways == ["dp-gather", "ddp"]
    assert not_measured == {"dp-replica-loss": "not requested (WAYS)"}


@pytest.mark.parametrize(
    ("requested", "hardware", "message"),
    [
        (["dp-replica-loss"], CPU, "needs 2 or more GPUs"),
        (["dp-gather"], ONE_GPU, "needs 2 or more GPUs"),
        (["ddp", "zero"], FOUR_GPUS, "unknown way(s) zero"),
        ("ddp", FOUR_GPUS, "a non-empty list"),
        ([], FOUR_GPUS, "a non-empty list"),
    ],
)
def test_impossible_requests_are_refused_with_the_fix(requested, hardware, message):
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tt.choose_placements(requested, hardware)
