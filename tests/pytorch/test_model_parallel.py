"""common.pytorch.model_parallel: the two-stage split, naive model parallelism, the GPipe pipeline and the bubble
arithmetic."""

import json
import time

import gloo_ranks
import pandas as pd
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from common.data import chestxray
from common.errors import InputError
from common.pytorch import model_parallel as parallel
from common.pytorch import training as tt
from common.pytorch import utils as tu
from common.run import devices

STAGE_PARAMETERS = [1_429_632, 5_538_574]  # DenseNet-121 with 14 outputs, cut before denseblock3
TOTAL_PARAMETERS = 6_968_206


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tu.build_densenet121()


def test_stages_hold_every_parameter_once(model):
    stages = parallel.split_densenet(model)
    assert parallel.parameters_per_stage(stages) == STAGE_PARAMETERS
    assert sum(STAGE_PARAMETERS) == TOTAL_PARAMETERS == tu.trainable_parameters(model)
    first, last = ({id(p) for p in stage.parameters()} for stage in stages)
    assert not first & last


def test_stage_states_together_are_the_model_state(model):
    merged = parallel.merge_states([stage.state_dict() for stage in parallel.split_densenet(model)])
    assert merged.keys() == model.state_dict().keys()
    fresh = tu.build_densenet121()
    fresh.load_state_dict(merged)  # strict: every key of the whole model, none extra
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, model.state_dict()[name]), name


def test_overlapping_states_are_refused(model):
    state = parallel.split_densenet(model)[0].state_dict()
    with pytest.raises(ValueError, match="overlap"):
        parallel.merge_states([state, state])


def test_split_point_must_be_a_later_feature_layer(model):
    with pytest.raises(ValueError, match="cannot split"):
        parallel.split_densenet(model, at="conv0")
    with pytest.raises(ValueError, match="cannot split"):
        parallel.split_densenet(model, at="denseblock9")


def test_naive_model_parallel_equals_the_whole_model(model):
    images = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    model.eval()
    try:
        with torch.no_grad():
            whole = model(images)
            naive = parallel.NaiveModelParallel(parallel.split_densenet(model), ["cpu", "cpu"])(images)
    finally:
        model.train()
    assert torch.equal(naive, whole)  # the same operations in the same order: not even rounding differs


def test_stage_input_has_the_shape_that_crosses_the_cut(model):
    stages = parallel.split_densenet(model)
    images = torch.randn(5, 3, 64, 64)
    before = {name: value.clone() for name, value in stages[0].state_dict().items()}
    assert parallel.stage_input(stages, 0, images) is images
    assert parallel.stage_input(stages, 1, images).shape == (5, 256, 4, 4)  # 256 channels at 1/16 of the size
    for name, value in stages[0].state_dict().items():  # the probe ran on a copy: statistics untouched
        assert torch.equal(value, before[name]), name


def test_a_stage_alone_computes_its_gradients(model):
    stages = parallel.split_densenet(model)
    images, labels = parallel.random_batch(4, 32, 0, "cpu")
    for index, stage in enumerate(stages):
        stage.zero_grad(set_to_none=True)
        parallel.stage_alone_step(stage, index, parallel.stage_input(stages, index, images), labels, 2, "fp32")()
        assert all(p.grad is not None for p in stage.parameters())
        stage.zero_grad(set_to_none=True)


def test_accumulated_micro_batches_average_the_gradient():
    """With m micro-batches and no BatchNorm, the accumulated step is the full-batch step."""
    torch.manual_seed(0)
    net = torch.nn.Linear(6, 14)
    images, labels = torch.randn(8, 6), torch.randint(0, 2, (8, 14)).float()
    accumulated = parallel.accumulated_step(net, torch.optim.SGD(net.parameters(), lr=0.0), images, labels, 4)
    accumulated_grad = net.weight.grad.clone()
    net.zero_grad()
    full = parallel.bce_loss(net(images), labels)
    full.backward()
    torch.testing.assert_close(accumulated, full.detach())
    torch.testing.assert_close(accumulated_grad, net.weight.grad)


def test_random_batch_is_the_same_for_the_same_seed():
    first, second = parallel.random_batch(4, 32, 7, "cpu"), parallel.random_batch(4, 32, 7, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert first[0].shape == (4, 3, 32, 32) and first[1].shape == (4, 14)


def test_labels_loader_reads_in_the_order_of_the_image_loader(standin):
    split = chestxray.load(standin, seed=0, check=False)["train"]
    whole = parallel.single_process(torch.device("cpu"))
    images = tt.sharded_loader(split, tu.eval_transform(32), 8, whole, shuffle=True, seed=3, workers=0)
    labels = parallel.labels_loader(split, 8, seed=3)
    assert len(images) == len(labels)
    for epoch in (0, 1):
        images.sampler.set_epoch(epoch)
        labels.sampler.set_epoch(epoch)
        for (_, image_labels, image_index), (label_rows, label_index) in zip(images, labels):
            assert torch.equal(image_index, label_index)
            assert torch.equal(image_labels.float(), label_rows)


def test_textbook_bubble():
    assert parallel.textbook_bubble(2, 1) == 0.5  # one micro-batch: each stage idles while the other works
    assert parallel.textbook_bubble(2, 4) == pytest.approx(0.2)
    assert parallel.textbook_bubble(4, 12) == pytest.approx(3 / 15)
    assert parallel.textbook_bubble(1, 8) == 0.0  # one stage never waits


def test_measured_bubble():
    assert parallel.bubble_fraction(0.6, 1.0) == pytest.approx(0.4)
    assert parallel.bubble_fraction(1.0, 1.0) == 0.0
    # paired steps: the median pair, so one step disturbed by other work on the machine does not decide
    assert parallel.bubble_fraction([0.6, 0.6, 3.0], [1.0, 1.0, 1.0]) == pytest.approx(0.4)
    with pytest.raises(ValueError):
        parallel.bubble_fraction(1.0, 0.0)
    with pytest.raises(ValueError):
        parallel.bubble_fraction([1.0, 1.0], [1.0])


def test_benchmark_entries_of_both_processes_merge():
    def entry(device, parameters, seconds, alone=None):
        found = {
            "images_per_second": 32 / seconds,
            "seconds_per_step": seconds,
            "start": 0.0,
            "end": 1.0,
            "parameters_per_device": {device: parameters},
            "peak_memory_mib_per_device": {},
        }
        if alone is None:
            return found
        return {**found, "alone_seconds": alone, "step_seconds": [seconds] * len(alone), "micro_batches": 4}

    per_rank = [
        {
            "single-device": entry("cpu:0", TOTAL_PARAMETERS, 1.0),
            "pipeline-gpipe m=4": entry("cpu:0", 10, 0.5, [0.4, 0.4, 0.45]),
        },
        {"pipeline-gpipe m=4": entry("cpu:1", 20, 0.5, [0.2, 0.1, 0.2])},
    ]
    merged = parallel.merge_benchmark(per_rank)
    pipeline = merged["pipeline-gpipe m=4"]
    assert pipeline["parameters_per_device"] == {"cpu:0": 10, "cpu:1": 20}
    assert pipeline["bubble"]["measured"] == pytest.approx([0.2, 0.6])
    assert pipeline["bubble"]["textbook"] == pytest.approx(0.2)
    assert "alone_seconds" not in pipeline and "bubble" not in merged["single-device"]
    table = parallel.bubble_table(merged)
    assert list(table.columns) == ["micro-batches", "textbook", "stage 0 measured", "stage 1 measured"]
    assert parallel.benchmark_table(merged).loc["pipeline-gpipe m=4", "x one device"] == pytest.approx(2.0)
    assert set(parallel.extra_fields(pipeline)) == {
        "seconds_per_step",
        "micro_batches",
        "bubble",
        "stage_alone_seconds",
        "stage_step_seconds",
    }


def test_advice_quotes_this_runs_numbers():
    def entry(rate, parameters, m=None, measured=None):
        found = {"images_per_second": rate, "parameters_per_device": parameters, "peak_memory_mib_per_device": {}}
        if m:
            found.update(
                micro_batches=m,
                seconds_per_step=32 / rate,
                bubble={"micro_batches": m, "measured": measured, "textbook": parallel.textbook_bubble(2, m)},
            )
        return found

    benchmark = {
        "single-device": entry(40.0, {"cpu:0": 7}),
        "naive-model-parallel": entry(38.0, {"cpu:0": 2, "cpu:1": 5}),
        "pipeline-gpipe m=1": entry(39.0, {"cpu:0": 2}, 1, [0.3, 0.6]),
        "pipeline-gpipe m=4": entry(50.0, {"cpu:0": 2}, 4, [0.2, 0.4]),
        "ddp": entry(70.0, {"cpu:0": 7}),
    }
    sweep = pd.DataFrame({"learning rate": [1e-3, 2e-3], "test AUC": [0.8, 0.85], "seconds": [10.0, 11.0]})
    lines = parallel.advice(benchmark, [2, 5], {"forward": [0.2, 0.1], "backward": [0.4, 0.3]}, sweep, "cpu")
    text = "\n".join(lines)
    assert "DDP 70.0 images/s (1.75x one device)" in text and "choose DDP" in text
    assert "m=1: 30% / 60% (textbook 50%); m=4: 20% / 40% (textbook 20%)" in text
    assert "the busier stage 0 idled 30% and the lighter stage 1, waiting for it, 60%" in text
    assert "shrank the stages' mean bubble (45% at m=1, 30% at m=4)" in text and "fastest pipeline here had m=4" in text
    assert "splits the 7 parameters 2 on cpu:0 and 5 on cpu:1 (71% on the fuller device" in text
    assert "best at learning rate 0.002" in text
    assert "stage 0 holds 29% of the parameters but took 60% of the forward and backward time" in text
    assert parallel.pipeline_step_seconds(benchmark) == {1: 32 / 39.0, 4: 32 / 50.0}
    assert "Only GPUs measure: peak_memory_mib_per_device" in text and "activation_copy_seconds" in text


def test_model_parallelism_needs_two_devices():
    with pytest.raises(InputError, match="needs 2 devices.*set DEVICES to 2"):
        parallel.check_devices(devices.resolve(1, gpus=[], cores=4))
    with pytest.raises(InputError, match="needs 2 devices.*set DEVICES to 2"):
        parallel.check_devices(devices.resolve(1, gpus=["A100", "A100"]))
    with pytest.raises(InputError, match="needs 2 devices.*2 or more GPUs"):
        parallel.check_devices(devices.resolve(1, gpus=["A100"]))
    with pytest.raises(InputError, match="needs 2 devices.*2 or more cores"):
        parallel.check_devices(devices.resolve(None, gpus=[], cores=1))
    parallel.check_devices(devices.resolve(2, gpus=[], cores=2))


def test_micro_batches_must_divide_the_global_batch():
    assert parallel.check_micro_batches([1, 2, 4], 32) == (1, 2, 4)
    assert parallel.check_micro_batches(8, 32) == (8,)
    for bad in ((3,), (0,), (True,), (), (64,)):
        with pytest.raises(InputError):
            parallel.check_micro_batches(bad, 32)


def test_sweep_learning_rates_centre_on_the_base():
    assert parallel.sweep_learning_rates(1e-3, 1) == [1e-3]
    assert parallel.sweep_learning_rates(1e-3, 2) == pytest.approx([1e-3, 2e-3])
    assert parallel.sweep_learning_rates(1e-3, 3) == pytest.approx([5e-4, 1e-3, 2e-3])
    assert parallel.sweep_learning_rates(1e-3, 5) == pytest.approx([2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3])
    assert parallel.sweep_learning_rates(1e-3, 2, [3e-4, 3e-3]) == [3e-4, 3e-3]
    with pytest.raises(InputError, match="one positive learning rate per device"):
        parallel.sweep_learning_rates(1e-3, 2, [1e-3])


def test_cpu_runs_name_what_only_gpus_measure():
    assert "peak_memory_mib_per_device" in parallel.not_measured("cpu", "pipeline-gpipe m=4")
    assert "activation_copy_seconds" in parallel.not_measured("cpu", "naive-model-parallel")
    assert parallel.not_measured("gpu", "pipeline-gpipe m=4") == {}


# The two-process check: GPipe over gloo against one device running the same micro-batches. With m=3 the
# gradient scale 1/3 is not exact in binary, so the two differ by rounding (about 1e-6), which the tolerance
# must cover; micro-batches of 8 images keep BatchNorm from amplifying it (see EQUIVALENCE_TOLERANCE).
EQUIVALENCE = dict(seed=0, image_size=32, batch=24, micro_batches=3, steps=3)
SPAWN_TIMEOUT = 120
CPU = torch.device("cpu")


# The notebook's pipeline, as its launched script pipeline.py writes it, for the check to run on here (the notebook's
# own test runs the check on the script's code). The script's stage index and device are its rank and its device;
# these processes are gloo ranks on the CPU.
def gpipe(stage, micro_batches, precision="fp32"):
    stage = PipelineStage(parallel.Autocast(stage, precision, CPU), dist.get_rank(), parallel.STAGES, CPU)
    return ScheduleGPipe(stage, n_microbatches=micro_batches, loss_fn=parallel.bce_loss, scale_grads=True)


def pipeline_step(schedule, images, labels):
    if dist.get_rank() == 0:
        schedule.step(images)
        return None
    losses = []
    schedule.step(target=labels, losses=losses, return_outputs=False)
    return torch.stack(losses).detach().mean()


def rank_main(rank: int, port: int, out: str) -> None:
    process = gloo_ranks.join(rank, 2, port)
    try:
        found = parallel.check_equivalence(process, gpipe, pipeline_step, **EQUIVALENCE)
        with open(f"{out}.rank{rank}", "w") as file:
            json.dump(found, file)
    finally:
        torch.distributed.destroy_process_group()


def spawn_pipeline(out: str) -> None:
    """Both processes, killed if they outlive the timeout (a hung send/receive must not hang the suite)."""
    context = mp.spawn(rank_main, args=(gloo_ranks.free_port(), out), nprocs=2, join=False)
    deadline = time.monotonic() + SPAWN_TIMEOUT
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the 2-process pipeline did not finish in {SPAWN_TIMEOUT} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()


def test_gloo_pipeline_matches_one_device_on_the_same_micro_batches(tmp_path):
    out = str(tmp_path / "equivalence")
    spawn_pipeline(out)
    found = [json.loads(open(f"{out}.rank{rank}").read()) for rank in range(2)]
    merged = parallel.merge_equivalence(found)
    assert merged["steps"] == 3 and len(merged["pipeline_losses"]) == 3
    assert merged["max_abs_loss_difference"] <= parallel.EQUIVALENCE_TOLERANCE
    # the weights moved, so the agreement is not that of untouched models
    assert merged["max_abs_parameter_update"] > 1e-4
    # BatchNorm over the whole batch differs from per-micro-batch statistics by far more than rounding
    assert merged["max_abs_loss_difference_to_full_batch"] > 10 * parallel.EQUIVALENCE_TOLERANCE


def test_timing_the_stages_in_the_kernel_leaves_the_device_and_releases_its_memory(monkeypatch):
    """The notebook's kernel times the stages on GPU 0, then launches processes that need that GPU's memory."""
    released = []
    monkeypatch.setattr(tu, "release_memory", lambda: released.append(True))
    stages = parallel.split_densenet(tu.build_densenet121())
    seconds = parallel.stage_seconds(stages, 2, 32, "fp32", torch.device("cpu"), repeats=1)
    for part in ("forward", "backward"):
        assert len(seconds[part]) == parallel.STAGES and all(s > 0 for s in seconds[part]), part
    assert released, "the allocator's cache goes back to the driver"
    assert all(p.device.type == "cpu" and p.grad is None for stage in stages for p in stage.parameters())
