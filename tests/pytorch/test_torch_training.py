"""The shared pieces of the PyTorch experiment notebooks: which placements a machine can measure, the timing helper."""

import pytest
import torch

from common.errors import InputError
from common.pytorch import training as tt
from common.run import devices, params

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


def test_the_schedule_is_the_projects_and_resumes_where_it_stopped():
    """Each update uses the rate of :func:`params.schedule_factor` (warmup from 0, then the cosine), also after a
    checkpoint's ``state_dict`` was loaded into a new scheduler mid-way."""
    steps, peak = 30, 0.1

    def optimizer():
        return torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=peak)

    first = optimizer()
    scheduler = tt.warmup_cosine(first, steps)
    used = []
    for _ in range(12):
        used.append(first.param_groups[0]["lr"])
        first.step()
        scheduler.step()
    resumed = optimizer()
    resumed_scheduler = tt.warmup_cosine(resumed, steps)
    resumed.load_state_dict(first.state_dict())  # as a checkpoint restores them
    resumed_scheduler.load_state_dict(scheduler.state_dict())
    for _ in range(12, steps):
        used.append(resumed.param_groups[0]["lr"])
        resumed.step()
        resumed_scheduler.step()
    assert used == pytest.approx([peak * params.schedule_factor(step, steps) for step in range(steps)])
    assert used[0] == 0 and max(used) == pytest.approx(peak)
