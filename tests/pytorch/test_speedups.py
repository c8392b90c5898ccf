"""common.pytorch.speedups and common.teach.toolbox: the tricks that change the arithmetic compute the plain step, and
the toolbox's sums are right."""

import json
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from common.pytorch import speedups as sp
from common.teach import toolbox

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def checks():
    return sp.check_arithmetic(CPU, accumulation=4)["largest difference"]


def test_gradient_accumulation_gives_the_big_batch_gradients(checks):
    # BatchNorm aside (evaluation mode): each micro-batch would otherwise be normalized by its own statistics
    assert checks["4 micro-batches"] < 1e-5


def test_activation_checkpointing_leaves_the_gradients_unchanged(checks):
    assert checks["checkpointing"] < 1e-6


def notebook_cell(start: str) -> str:
    """The source of the one code cell of PyTorch_Speedups that starts with ``start``: tests run the page's own code."""
    cells = json.loads((Path(__file__).parents[2] / "notebooks" / "PyTorch_Speedups.ipynb").read_text())["cells"]
    (source,) = [s for s in ("".join(cell["source"]) for cell in cells) if s.startswith(start)]
    return source


def notebook_step():
    """The training step that PyTorch_Speedups writes to a file and times: the very cell, run here as a module."""
    module = types.ModuleType("speedup_step")
    source = notebook_cell("%%writefile {work_dir}/speedup_step.py").split("\n", 1)[1]
    exec(compile(source, "speedup_step.py", "exec"), module.__dict__)
    return module.training_step


def test_checkpointing_whole_blocks_leaves_the_gradients_unchanged():
    """The page's torch.utils.checkpoint around each dense block: the same gradients as keeping every activation."""
    page = {"torch": torch, "sp": sp, "device": CPU}
    exec(notebook_cell("class Checkpointed(torch.nn.Module):"), page)
    checkpointed, plain = page["blocks_checkpointed"]().eval(), sp.densenet(CPU).eval()  # fixed BatchNorm statistics
    assert sum(isinstance(m, page["Checkpointed"]) for m in checkpointed.modules()) == 4
    images, labels = sp.random_batch(4, 32, CPU)
    gradients = []
    for model in (checkpointed, plain):
        nn.functional.binary_cross_entropy_with_logits(model(images), labels).backward()
        gradients.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert float((gradients[0] - gradients[1]).abs().max() / gradients[1].abs().max()) < 1e-6


def small_network():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 14))


def test_the_notebooks_step_accumulates_micro_batches_into_the_batchs_step():
    training_step = notebook_step()
    whole, accumulated = small_network(), small_network()
    data = sp.fixed_batch(8, 16, CPU)
    training_step(whole, data)(), training_step(accumulated, data, accumulation=4)()
    for a, b in zip(whole.parameters(), accumulated.parameters()):
        assert torch.allclose(a, b, atol=1e-6)  # one Adam step from the same gradients: the same weights


def test_a_compiled_step_takes_the_eager_steps_loss():
    """torch.compile on a small network (DenseNet-121 takes minutes to compile on a CPU): the same losses, step by
    step, within float32 rounding of fused kernels."""
    training_step = notebook_step()

    def losses(compile_it):
        model = small_network()
        step = training_step(model, sp.fixed_batch(4, 16, CPU), forward=torch.compile(model) if compile_it else None)
        return [step().item() for _ in range(3)]

    torch._dynamo.reset()
    assert losses(True) == pytest.approx(losses(False), rel=1e-5)


def test_the_batch_sweep_stops_at_the_first_batch_that_does_not_fit():
    def make_step(batch):
        if batch >= 32:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return lambda: None

    rows = sp.sweep_batches(make_step, [8, 16, 32, 64], CPU, steps=2, technique="batch size")
    assert [row.batch for row in rows] == [8, 16, 32] and "out of memory" in rows[-1].not_measured
    assert toolbox.largest_batch(rows) == 16


def test_a_ring_all_reduce_and_the_scaling_it_allows():
    # 2 (n-1)/n of the bytes over the link: 100 MB over 4 devices at 10 GB/s
    assert sp.ring_all_reduce_seconds(100e6, 4, 10e9) == pytest.approx(0.015)
    assert sp.predicted_efficiency(0.1, 100e6, 4, 10e9) == pytest.approx(0.1 / 0.115)
    assert sp.predicted_efficiency(0.1, 100e6, 1, 10e9) == 1.0  # one device sends nothing


def test_an_epoch_costs_the_full_data_sets_hours_at_the_measured_speed():
    rate = toolbox.FULL_DATA_SET_IMAGES / 3600
    rows = [toolbox.Measured("communication", "DDP", 16, images_per_second=rate, extra={"devices": 2})]
    prices = toolbox.costs(rows, price=4.0, spot_price=1.5, epochs=5)
    row = prices.loc[("communication", "DDP")]  # an hour on two devices: two device hours
    assert row["hours per epoch"] == pytest.approx(1.0) and row["price per epoch"] == pytest.approx(8.0)
    assert row["spot price per epoch"] == pytest.approx(3.0) and row["price of 5 epochs"] == pytest.approx(40.0)


def test_what_each_technique_bought_compares_its_fastest_setting_with_the_baseline():
    baseline = toolbox.Measured("baseline", "in RAM", 16, images_per_second=100.0)
    rows = [baseline, toolbox.Measured("precision", "bf16", 16, images_per_second=150.0),
            toolbox.Measured("precision", "fp16", 16, images_per_second=120.0),
            toolbox.Measured("precision", "fp16, channels_last", 16, not_measured="needs a GPU"),
            toolbox.Measured("compiler", "eager", 16, images_per_second=101.0),  # one setting: nothing compared
            toolbox.Measured("communication", "DDP", 16, images_per_second=190.0, extra={"devices": 2}),
            toolbox.Measured("communication", "step alone", 16, images_per_second=99.0)]  # fmt: skip
    bought = toolbox.what_each_bought(rows, baseline)
    assert bought.loc["precision", "fastest setting"] == "bf16" and bought.loc["precision", "speed-up"] == 1.5
    assert list(bought.index) == ["precision"]  # two devices are not a trick of one device


def test_each_measurement_in_the_kernel_releases_the_device_memory_it_used(monkeypatch):
    """The toolbox measures in the notebook's kernel; the communication processes it launches next need the GPU."""
    released = []
    monkeypatch.setattr(sp.tu, "release_memory", lambda: released.append(True))
    sp.measure("baseline", "in RAM", lambda: None, batch=2, steps=1, device=CPU)
    assert released == [True]
