"""The timing measurements: seconds per step, each stage's own work, the bubble, the samples of a timed phase."""

from __future__ import annotations

import copy
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from common.pytorch import utils as tu
from common.pytorch.model_parallel.pipeline import bce_loss, random_batch
from common.pytorch.model_parallel.split import STAGES


def seconds_per_step(step, steps: int, devices, *, together: bool, warmup: int = 2) -> float:
    """Wall seconds per call of ``step()`` over ``steps`` calls, after ``warmup`` untimed ones.

    ``together``: every process of the group starts and stops the clock at a barrier, so all measure the
    same span, until the slowest is done (a DDP step); otherwise one process times itself.
    """
    for _ in range(warmup):
        step()
    tu.synchronize(devices)
    if together:
        dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    tu.synchronize(devices)
    if together:
        dist.barrier()
    return (time.perf_counter() - start) / steps


def paired_times(pipelined, alone, steps: int, devices, warmup: int = 2) -> tuple[list[float], list[float]]:
    """Seconds of ``steps`` pipeline steps and of as many steps of this process's stage alone, taken in turn.

    A pipeline step is timed from a barrier until every process is done with it; the stage alone from the
    next barrier until this process is done. In turn, both meet the same load on a shared machine: a burst
    of other work slows both instead of passing for a bubble.
    """
    for _ in range(warmup):
        pipelined()
        alone()
    tu.synchronize(devices)
    step_seconds, alone_seconds = [], []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        pipelined()
        tu.synchronize(devices)
        dist.barrier()
        step_seconds.append(time.perf_counter() - start)
        start = time.perf_counter()
        alone()
        tu.synchronize(devices)
        alone_seconds.append(time.perf_counter() - start)
    return step_seconds, alone_seconds


def training_step(model: nn.Module, optimizer, images, labels, precision: str, device):
    """A function doing one full training step (forward, loss, backward, Adam) on a fixed batch."""

    def step():
        optimizer.zero_grad(set_to_none=True)
        with tu.autocast(precision, torch.device(device)):
            logits = model(images)
        bce_loss(logits, labels.to(logits.device)).backward()
        optimizer.step()

    return step


def stage_alone_step(stage: nn.Module, index: int, inputs, labels, micro_batches: int, precision: str, optimizer=None):
    """A function doing what stage ``index`` computes in one pipeline step, without any communication.

    Forward and backward of each micro-batch, then the optimizer step (if given: the timed pipeline step has
    one too). The first stage's backward starts from a fixed output gradient; the last stage's input requires
    a gradient, as in the pipeline, which sends that gradient back to the first stage.
    """
    device = inputs.device
    micro_inputs, micro_labels = inputs.chunk(micro_batches), labels.chunk(micro_batches)
    last = index == STAGES - 1

    def step():
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        for x, y in zip(micro_inputs, micro_labels):
            x = x.detach().requires_grad_(index > 0)
            with tu.autocast(precision, device):
                out = stage(x)
            if last:
                (bce_loss(out, y) / micro_batches).backward()
            else:
                out.backward(torch.full_like(out, 1e-3))
        if optimizer is not None:
            optimizer.step()

    return step


def stage_input(stages, index: int, images: torch.Tensor) -> torch.Tensor:
    """The images for the first stage; for a later one, noise of the shape that crosses the cut into it."""
    if index == 0:
        return images
    x = torch.zeros(images[:1].shape)
    with torch.no_grad():
        for stage in stages[:index]:  # a copy in eval mode: the probe must not touch the stage or its statistics
            x = copy.deepcopy(stage).cpu().eval()(x)
    shape = x.shape
    generator = torch.Generator().manual_seed(index)
    return torch.randn((len(images), *shape[1:]), generator=generator).to(images.device)


def stage_seconds(
    stages, batch: int, image_size: int, precision: str, device: torch.device, seed: int = 0, repeats: int = 2
) -> dict[str, list[float]]:
    """Forward and backward seconds of each stage on a random batch of ``batch`` images, on ``device``:
    ``{"forward": [...], "backward": [...]}``, one value per stage, each the mean of ``repeats`` timed passes after an
    untimed one. The last stage's forward includes the loss.

    Parameters say how much memory a stage needs; these times say how much work: the pipeline runs at the
    pace of the slower stage, and the notebook draws its GPipe schedule from them (:mod:`common.teach.pictures`). It
    runs in the notebook's kernel, so the batch and the stages leave the device afterwards and the memory is released:
    the launches that follow need it.
    """
    images, labels = random_batch(batch, image_size, seed, device)
    seconds = {"forward": [], "backward": []}
    for index, stage in enumerate(stages):
        x = stage_input(stages, index, images)
        stage.to(images.device)
        timed = [_forward_backward(stage, index, x, labels, precision) for _ in range(1 + repeats)][1:]
        for part, values in zip(("forward", "backward"), zip(*timed)):
            seconds[part].append(float(np.mean(values)))
        stage.zero_grad(set_to_none=True)
        del x
        stage.to("cpu")
    del images, labels
    tu.release_memory()
    return seconds


def _forward_backward(stage: nn.Module, index: int, inputs, labels, precision: str) -> tuple[float, float]:
    """Seconds of one forward of stage ``index`` and of the backward after it, as :func:`stage_alone_step` runs them."""
    device = inputs.device
    x = inputs.detach().requires_grad_(index > 0)
    tu.synchronize([device])
    start = time.perf_counter()
    with tu.autocast(precision, device):
        out = stage(x)
    last = index == STAGES - 1
    loss = bce_loss(out, labels) if last else None
    tu.synchronize([device])
    middle = time.perf_counter()
    if last:
        loss.backward()
    else:
        out.backward(torch.full_like(out, 1e-3))
    tu.synchronize([device])
    return middle - start, time.perf_counter() - middle


def textbook_bubble(stages: int, micro_batches: int) -> float:
    """GPipe's idle share of a step with equal stages and free communication: (p - 1) / (m + p - 1)."""
    return (stages - 1) / (micro_batches + stages - 1)


def bubble_fraction(alone_seconds, step_seconds) -> float:
    """The share of a pipeline step in which a stage did not compute: 1 - its own compute time / the step time.

    It counts waiting for the other stage, the sends and receives, and any imbalance between the stages.
    Given paired lists (see :func:`paired_times`), the median of the pairs' fractions: robust to a disturbed pair.
    """
    alone, steps = np.atleast_1d(alone_seconds), np.atleast_1d(step_seconds)
    if len(alone) != len(steps) or not len(steps) or (steps <= 0).any():
        raise ValueError(f"need as many positive step times as alone times, got {steps} and {alone}")
    return float(np.median(1.0 - alone / steps))


def merge_benchmark(per_rank: list[dict]) -> dict[str, dict]:
    """One entry per variant from what each process measured on its own device; the first process's clock.

    A pipeline entry gets its bubble: per stage, from the stage's steps alone and the pipeline steps taken in
    turn with them (see :func:`bubble_fraction`).
    """
    merged: dict[str, dict] = {}
    for found in per_rank:
        for variant, entry in found.items():
            into = merged.setdefault(variant, {**entry, "parameters_per_device": {}, "peak_memory_mib_per_device": {}})
            into["parameters_per_device"].update(entry["parameters_per_device"])
            into["peak_memory_mib_per_device"].update(entry["peak_memory_mib_per_device"])
            if "alone_seconds" in entry:
                into.setdefault("stage_alone_seconds", []).append(entry["alone_seconds"])
                into.setdefault("stage_step_seconds", []).append(entry["step_seconds"])
    for entry in merged.values():
        if "micro_batches" in entry:
            entry.pop("alone_seconds")
            entry.pop("step_seconds")
            entry["bubble"] = {
                "micro_batches": entry["micro_batches"],
                "measured": [
                    bubble_fraction(alone, step)
                    for alone, step in zip(entry["stage_alone_seconds"], entry["stage_step_seconds"])
                ],
                "textbook": textbook_bubble(STAGES, entry["micro_batches"]),
            }
    return merged
