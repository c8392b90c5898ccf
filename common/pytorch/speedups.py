"""What ``PyTorch_Speedups`` measures with: the timing, the batches, and the communication and profiler figures.

The techniques themselves (autocast, channels_last, ``torch.compile``, checkpointing, ``DataLoader`` workers, cuDNN
autotuning, the profiler, ``no_sync``) are written out in the notebook and in the training step it writes. Every
measurement is one :class:`common.teach.toolbox.Measured` row, reported through :mod:`common.teach.toolbox` as Keras'
are. The tests check that each trick that changes the arithmetic (gradient accumulation, activation checkpointing, a
compiler) computes what the plain step computes.
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

import pandas as pd
import torch
import torchvision
from torch import nn

from common.measure.phases import timed_steps
from common.pytorch import utils as tu
from common.run.params import NUM_CLASSES
from common.teach.toolbox import Measured, not_measured

GPU_COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
# Kineto, torch.profiler's engine, prints "USDT profiler_start/stop" notices up to level 5: 6 is above them all
os.environ.setdefault("KINETO_LOG_LEVEL", "6")


# ---------------------------------------------------------------- the parameters


def compile_modes(given, kind: str) -> tuple[list[str], str | None]:
    """The torch.compile modes to measure, and why none are measured when so."""
    if given is not None:
        return list(given), None
    if kind == "gpu":
        return list(GPU_COMPILE_MODES), None
    return [], "compiling DenseNet-121 takes minutes on a CPU: set COMPILE_MODES=['default'] to measure it anyway"


def loader_workers(given, cores: int) -> list[int]:
    return sorted(set(given)) if given is not None else sorted({0, 1, max(1, cores // 2), cores})


# ---------------------------------------------------------------- building and timing steps


def densenet(device: torch.device, memory_efficient: bool = False) -> nn.Module:
    """DenseNet-121 with 14 outputs on ``device``, from the same seed every time; ``memory_efficient`` recomputes each
    dense layer's bottleneck (concat, BatchNorm, ReLU, 1x1 convolution) in the backward pass instead of keeping its
    activations: torchvision wraps that part, and only that part, in ``torch.utils.checkpoint``."""
    torch.manual_seed(0)
    return torchvision.models.densenet121(num_classes=NUM_CLASSES, memory_efficient=memory_efficient).to(device)


def random_batch(batch: int, image_size: int, device, layout=torch.contiguous_format):
    """Normal images and sparse labels, the same for the same batch size."""
    generator = torch.Generator().manual_seed(batch)
    images = torch.randn(batch, 3, image_size, image_size, generator=generator)
    labels = (torch.rand(batch, NUM_CLASSES, generator=generator) < 0.1).float()
    return images.to(device, memory_format=layout), labels.to(device)


def fixed_batch(batch: int, image_size: int, device, layout=torch.contiguous_format):
    """:func:`random_batch` held in device memory, endlessly: the step's data without an input pipeline."""
    return itertools.repeat(random_batch(batch, image_size, device, layout))


def on_device(loader, device):
    """The batches of ``loader``, epoch after epoch, as the training step takes them: the model's input and the
    labels on ``device``."""
    for images, labels, _ in itertools.chain.from_iterable(itertools.repeat(loader)):
        yield tu.to_model_input(images, device), labels.to(device, non_blocking=True)


def cannot_compute(dtype, device) -> str | None:
    """Why ``device`` cannot run autocast in ``dtype`` at its own speed, or None when it can."""
    if dtype is torch.float16 and device.type != "cuda":
        return "fp16 autocast needs a GPU"
    if dtype is torch.bfloat16 and device.type == "cuda" and not tu.native_bf16():
        return "this GPU has no bf16 of its own (emulated)"
    return None


def measure(technique: str, setting: str, step, batch: int, steps: int, device, warmup: int = 2, **extra) -> Measured:
    """Time ``steps`` calls of ``step()`` after ``warmup`` ones timed apart; the peak memory of all of them (GPUs).

    The notebook's kernel lives on after each measurement: the GPU memory its allocator cached goes back to the
    driver (:func:`common.pytorch.utils.release_memory`), for the processes the notebook launches next."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    try:
        began = time.time()
        seconds = timed_steps(step, steps, lambda _: tu.synchronize([device]), warmup=warmup)
        first = time.time() - began - seconds
        peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    finally:
        del step
        tu.release_memory()
    return Measured(technique, setting, batch, steps * batch / seconds, first, peak, None, began, time.time(), extra)


def sweep_batches(make_step, batches, device, steps: int, technique: str) -> list[Measured]:
    """Images/s and peak memory at each of ``batches`` (ascending), stopping at the first that does not fit: the
    largest batch is found, not guessed. ``make_step(batch)`` builds the step."""
    rows = []
    for batch in batches:
        try:
            rows.append(measure(technique, f"batch {batch}", make_step(batch), batch, steps, device))
        except torch.OutOfMemoryError as error:
            tu.release_memory()
            rows.append(not_measured(technique, f"batch {batch}", batch, f"out of memory: {str(error)[:60]}"))
            break
    return rows


# ---------------------------------------------------------------- communication and cost


def all_reduce_seconds(elements: int, device, repeats: int) -> float:
    """Seconds of one all-reduce (sum) of ``elements`` fp32 numbers over the process group, the median of
    ``repeats`` after a warm-up."""
    import torch.distributed as dist

    tensor = torch.ones(elements, device=device)
    dist.all_reduce(tensor)
    times = []
    for _ in range(repeats):
        tu.synchronize([device])
        start = time.perf_counter()
        dist.all_reduce(tensor)
        tu.synchronize([device])
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def ring_all_reduce_seconds(gradient_bytes: float, devices: int, bandwidth: float) -> float:
    """A ring all-reduce sends each byte 2 (n-1)/n times over the slowest link: the textbook time, latency aside."""
    return 2 * (devices - 1) / devices * gradient_bytes / bandwidth


def predicted_efficiency(step_seconds: float, gradient_bytes: float, devices: int, bandwidth: float) -> float:
    """Scaling efficiency if the all-reduce ran after the backward pass instead of beside it: a lower bound (DDP
    overlaps the two bucket by bucket, which only helps)."""
    return step_seconds / (step_seconds + ring_all_reduce_seconds(gradient_bytes, devices, bandwidth))


# ---------------------------------------------------------------- the notebook's sections


def check_arithmetic(device, accumulation: int, compile_mode: str | None = None, batch: int = 8, size: int = 32):
    """Each trick's step against the plain one on one small batch: the largest gradient difference relative to the
    largest gradient (accumulation, checkpointing), and the loss difference (a compiler)."""

    def gradients(model, micro_batches=1, forward=None):
        images, labels = random_batch(batch, size, device)
        model.zero_grad()
        for micro_images, micro_labels in zip(images.chunk(micro_batches), labels.chunk(micro_batches)):
            loss = nn.functional.binary_cross_entropy_with_logits((forward or model)(micro_images), micro_labels)
            (loss / micro_batches).backward()
        flat = torch.cat([p.grad.flatten() for p in model.parameters()])
        return flat, loss.item()

    def relative(a, b):
        return float((a - b).abs().max() / b.abs().max())

    plain = densenet(device).eval()  # fixed BatchNorm statistics: the one thing micro-batches compute differently
    reference, plain_loss = gradients(plain)
    rows = {
        f"{accumulation} micro-batches": relative(gradients(plain, accumulation)[0], reference),
        "checkpointing": relative(gradients(densenet(device, memory_efficient=True).eval())[0], reference),
    }
    if compile_mode:
        torch._dynamo.reset()
        model = densenet(device).eval()
        rows[f"torch.compile {compile_mode} (loss)"] = abs(
            gradients(model, forward=torch.compile(model, mode=compile_mode))[1] - plain_loss
        )
    return pd.DataFrame({"largest difference": rows}).rename_axis("against the plain step")


def communication_rows(result: dict) -> list[Measured]:
    """The communication script's rows, DDP's as the images/s of all its processes."""
    rows = []
    for found in result["rows"]:
        row = Measured(**found)
        if row.setting != "step alone" and row.images_per_second:
            row.images_per_second *= result["processes"]
            row.extra["devices"] = result["processes"]
        rows.append(row)
    return rows


def scaling_check(result: dict, gradient_bytes_: int) -> str:
    """The scaling efficiency predicted from the measured all-reduce (no overlap: a lower bound) against the
    measured one, on the devices the communication script ran on."""
    rows = {row["setting"]: row for row in result["rows"]}
    processes, alone = result["processes"], rows["step alone"]["images_per_second"]
    step_seconds = rows["step alone"]["batch"] / alone
    measured = rows["DDP"]["images_per_second"] / alone  # per process, against one process alone
    bandwidth = 2 * (processes - 1) / processes * gradient_bytes_ / result["all_reduce_seconds"]
    predicted = predicted_efficiency(step_seconds, gradient_bytes_, processes, bandwidth)
    return (
        f"{processes} processes: the all-reduce of {gradient_bytes_ / 2**20:.1f} MiB took "
        f"{result['all_reduce_seconds'] * 1000:.1f} ms ({bandwidth / 1e9:.2f} GB/s), a step alone "
        f"{step_seconds * 1000:.0f} ms: predicted scaling efficiency at least {predicted:.0%}, measured {measured:.0%}"
    )


def predicted_scaling(alone: Measured, gradient_bytes_: int, interconnects: dict, counts) -> pd.DataFrame:
    """Scaling efficiency at ``counts`` devices over each interconnect (nominal GB/s), from this device's measured
    step time: what the numbers above predict for a machine with several of these devices."""
    step_seconds = alone.batch / alone.images_per_second
    return pd.DataFrame(
        {
            name: {n: predicted_efficiency(step_seconds, gradient_bytes_, n, gbps * 1e9) for n in counts}
            for name, gbps in interconnects.items()
        }
    ).rename_axis("devices")


def communication_lines(communication: list[Measured]) -> list[str]:
    """What the DDP measurements say, for :func:`common.teach.toolbox.recommendation`."""
    lines = []
    ddp = {row.setting: row.images_per_second for row in communication if row.images_per_second}
    synced = [name for name in ddp if "micro-batches" in name and "no_sync" not in name]
    if synced and f"{synced[0]}, no_sync" in ddp:
        gain = ddp[f"{synced[0]}, no_sync"] / ddp[synced[0]]
        lines.append(f"Accumulating under DDP, no_sync() (one all-reduce per step) ran {gain:.2f}x as fast as without.")
    if "DDP" in ddp and "DDP, bf16 compression" in ddp:
        gain = ddp["DDP, bf16 compression"] / ddp["DDP"]
        lines.append(f"Compressing the gradients to bf16 ran {gain:.2f}x as fast as plain DDP on these devices.")
    return lines


# ---------------------------------------------------------------- the profiler's figures


def trace_path(folder, device) -> str:
    """Where a Chrome trace of this run's profile goes: ``folder`` (apart from the results records), named by the
    device and the time."""
    return str(Path(folder) / f"speedups-{device.type}-{time.strftime('%Y%m%d-%H%M%S')}.json")


def top_operators(prof, device, steps: int, count: int = 12) -> pd.DataFrame:
    """The ``count`` operators of a ``torch.profiler`` profile over ``steps`` steps that took the most device time (CPU
    time on a CPU), per step and as a share of all."""
    on_gpu = device.type == "cuda"
    key = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    averages = prof.key_averages()
    events = sorted(averages, key=lambda event: getattr(event, key), reverse=True)[:count]
    total = sum(getattr(event, key) for event in averages) or 1
    top = pd.DataFrame(
        {
            "operator": [event.key for event in events],
            "calls": [event.count for event in events],
            f"{'device' if on_gpu else 'CPU'} ms per step": [getattr(e, key) / 1000 / steps for e in events],
            "share": [getattr(event, key) / total for event in events],
        }
    )
    return top.set_index("operator").round(3)
