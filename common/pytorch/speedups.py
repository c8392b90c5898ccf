"""The speed-up toolbox in PyTorch: each way of training DenseNet-121 faster, measured on one device the same way.

Used by ``PyTorch_Speedups`` and its communication script. Every measurement is one
:class:`common.teach.toolbox.Measured` row, reported through :mod:`common.teach.toolbox` as Keras'
are. The tests check that
each trick that changes the arithmetic (gradient accumulation, activation checkpointing, a compiler) computes what the
plain step computes.
"""

from __future__ import annotations

import contextlib
import functools
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


def densenet(device: torch.device, layout=torch.contiguous_format, checkpointed: bool = False) -> nn.Module:
    """DenseNet-121 with 14 outputs on ``device``; ``checkpointed`` recomputes each dense layer's bottleneck (concat,
    BatchNorm, ReLU, 1x1 convolution) in the backward pass instead of keeping its activations (torchvision's
    ``memory_efficient``: ``torch.utils.checkpoint`` around that part only)."""
    torch.manual_seed(0)
    model = torchvision.models.densenet121(num_classes=NUM_CLASSES, memory_efficient=checkpointed)
    return model.to(device, memory_format=layout)


def random_batch(batch: int, image_size: int, device, layout=torch.contiguous_format):
    """Normal images and sparse labels, the same for the same batch size."""
    generator = torch.Generator().manual_seed(batch)
    images = torch.randn(batch, 3, image_size, image_size, generator=generator)
    labels = (torch.rand(batch, NUM_CLASSES, generator=generator) < 0.1).float()
    return images.to(device, memory_format=layout), labels.to(device)


def training_step(
    model: nn.Module, batches, precision: str, accumulation: int = 1, dtype=None, compiled=None, no_sync=None
):
    """One Adam step per call on the next ``(images, labels)`` of ``batches`` (a fixed batch: ``itertools.repeat``).

    ``accumulation`` micro-batches: each one's gradients added up, each loss divided by their number, one optimizer
    step: the step of the whole batch, BatchNorm aside (it normalizes each micro-batch by itself). ``dtype`` forces
    the autocast type (``torch.float16``, with loss scaling) instead of the device's own mixed type; ``compiled``
    is the model to run forward (``torch.compile(model)``, or a DDP wrapper), ``model`` keeps the weights;
    ``no_sync`` (DDP's ``model.no_sync``) skips the all-reduce of every micro-batch but the last.
    """
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    forward, loss_fn = compiled or model, nn.BCEWithLogitsLoss()
    device = next(model.parameters()).device
    half = precision == "mixed" and (dtype or tu.mixed_dtype(device)) == torch.float16
    scaler = torch.amp.GradScaler(device.type, enabled=half)
    batches = iter(batches)

    def autocast():
        if precision != "mixed":
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=dtype or tu.mixed_dtype(device))

    def step():
        images, labels = next(batches)
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        micro_batches = list(zip(images.chunk(accumulation), labels.chunk(accumulation)))
        for number, (micro_images, micro_labels) in enumerate(micro_batches, 1):
            skip = no_sync() if no_sync is not None and number < len(micro_batches) else contextlib.nullcontext()
            with skip:  # forward and backward both: DDP decides in the forward pass whether to all-reduce
                with autocast():
                    loss = loss_fn(forward(micro_images).float(), micro_labels) / accumulation
                scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return loss.detach()

    return step


def releasing(measurement):
    """The toolbox measures in the notebook's kernel, which lives on: after each measurement its GPU memory goes back
    to the driver, for the processes the notebook launches next (see :func:`common.pytorch.utils.release_memory`)."""

    @functools.wraps(measurement)
    def measured(*args, **kwargs):
        try:
            return measurement(*args, **kwargs)
        finally:
            tu.release_memory()

    return measured


def measure(technique: str, setting: str, step, batch: int, steps: int, device, warmup: int = 2, **extra) -> Measured:
    """Time ``steps`` calls of ``step()`` after ``warmup`` ones timed apart; the peak memory of all of them (GPUs)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    began = time.time()
    seconds = timed_steps(step, steps, lambda _: tu.synchronize([device]), warmup=warmup)
    first = time.time() - began - seconds
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return Measured(technique, setting, batch, steps * batch / seconds, first, peak, None, began, time.time(), extra)


@releasing
def sweep_batches(make_step, batches, device, steps: int, technique: str) -> list[Measured]:
    """Images/s and peak memory at each of ``batches`` (ascending), stopping at the first that does not fit: the
    largest batch is found, not guessed. ``make_step(batch)`` builds the step."""
    rows = []
    for batch in batches:
        try:
            rows.append(measure(technique, f"batch {batch}", make_step(batch), batch, steps, device))
        except torch.OutOfMemoryError as error:
            torch.cuda.empty_cache()
            rows.append(not_measured(technique, f"batch {batch}", batch, f"out of memory: {str(error)[:60]}"))
            break
    return rows


# ---------------------------------------------------------------- communication and cost


def gradient_bytes(model: nn.Module) -> int:
    """What one step all-reduces: every trainable parameter's gradient in fp32."""
    return 4 * sum(parameter.numel() for parameter in model.parameters() if parameter.requires_grad)


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


@releasing
def precision_and_layout(device, batch: int, image_size: int, steps: int) -> list[Measured]:
    """fp32, bf16 autocast and fp16 with loss scaling, each in the default layout and in channels_last."""
    rows = []
    for precision, dtype, name in (
        ("fp32", None, "fp32"),
        ("mixed", torch.bfloat16, "bf16"),
        ("mixed", torch.float16, "fp16 + loss scaling"),
    ):
        for layout, layout_name in ((torch.contiguous_format, "NCHW"), (torch.channels_last, "channels_last")):
            setting = f"{name}, {layout_name}"
            if dtype is torch.float16 and device.type != "cuda":
                rows.append(not_measured("precision", setting, batch, "fp16 autocast needs a GPU"))
                continue
            if dtype is torch.bfloat16 and device.type == "cuda" and not tu.native_bf16():
                rows.append(not_measured("precision", setting, batch, "this GPU has no bf16 of its own (emulated)"))
                continue
            data = itertools.repeat(random_batch(batch, image_size, device, layout))
            step = training_step(densenet(device, layout), data, precision, dtype=dtype)
            rows.append(measure("precision", setting, step, batch, steps, device))
    return rows


@releasing
def compilers(device, batch: int, image_size: int, steps: int, precision: str, modes, why_not) -> list[Measured]:
    """Eager against ``torch.compile`` in each of ``modes``; the compilation shows as ``first_steps_seconds``."""
    data = itertools.repeat(random_batch(batch, image_size, device))
    rows = [measure("compiler", "eager", training_step(densenet(device), data, precision), batch, steps, device)]
    if not modes:
        return [*rows, not_measured("compiler", "torch.compile", batch, why_not)]
    for mode in modes:
        torch._dynamo.reset()  # each mode compiles from scratch, its compilation timed in its own first steps
        model = densenet(device)
        step = training_step(model, data, precision, compiled=torch.compile(model, mode=mode))
        rows.append(measure("compiler", f"torch.compile {mode}", step, batch, steps, device))
    return rows


@releasing
def memory_for_speed(
    device, batch: int, image_size: int, steps: int, precision: str, accumulation: int, batches
) -> list[Measured]:
    """Activation checkpointing and gradient accumulation against the plain step at the same batch, and the largest
    batch that fits with checkpointing (GPUs: the sweep of ``batches`` beyond the plain step's largest)."""
    data = itertools.repeat(random_batch(batch, image_size, device))
    rows = [
        measure("memory", "plain", training_step(densenet(device), data, precision), batch, steps, device),
        measure(
            "memory",
            "checkpointing",
            training_step(densenet(device, checkpointed=True), data, precision),
            batch,
            steps,
            device,
        ),
        measure(
            "memory",
            f"{accumulation} micro-batches",
            training_step(densenet(device), data, precision, accumulation),
            batch,
            steps,
            device,
        ),
    ]
    if device.type != "cuda":
        return [*rows, not_measured("checkpointing", "largest batch", batch, "device memory is measured on GPUs")]

    def checkpointed(b):
        return training_step(
            densenet(device, checkpointed=True), itertools.repeat(random_batch(b, image_size, device)), precision
        )

    return rows + sweep_batches(checkpointed, batches, device, steps, "checkpointing")


@releasing
def autotuning(device, batch: int, image_size: int, steps: int, precision: str) -> list[Measured]:
    """cuDNN's kernel search on and off: what the first steps cost and the steady state gains."""
    if device.type != "cuda":
        return [not_measured("cuDNN autotuning", "on and off", batch, "cuDNN runs on NVIDIA GPUs")]
    rows, before = [], torch.backends.cudnn.benchmark
    try:
        for benchmark in (False, True):
            torch.backends.cudnn.benchmark = benchmark
            data = itertools.repeat(random_batch(batch, image_size, device))
            step = training_step(densenet(device), data, precision)
            rows.append(measure("cuDNN autotuning", "on" if benchmark else "off", step, batch, steps, device))
    finally:
        torch.backends.cudnn.benchmark = before
    return rows


@releasing
def profile(device, batch: int, image_size: int, precision: str, folder, steps: int = 3):
    """``torch.profiler`` over ``steps`` steps after two unprofiled ones: the top operators by device time (CPU time on
    a CPU), and the Chrome trace written into ``folder`` (apart from the results records), its path returned."""
    trace_path = Path(folder) / f"speedups-{device.type}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    # 6: above every level Kineto prints at, its "USDT profiler_start/stop" lines included (5 still shows those)
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    step = training_step(densenet(device), itertools.repeat(random_batch(batch, image_size, device)), precision)
    step(), step()
    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]
    with profiler(activities=activities) as prof:
        for _ in range(steps):
            step()
        tu.synchronize([device])
    prof.export_chrome_trace(str(trace_path))
    key = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda event: getattr(event, key), reverse=True)[:12]
    total = sum(getattr(event, key) for event in prof.key_averages()) or 1
    top = pd.DataFrame(
        {
            "operator": [event.key for event in events],
            "calls": [event.count for event in events],
            f"{'device' if on_gpu else 'CPU'} ms per step": [getattr(e, key) / 1000 / steps for e in events],
            "share": [getattr(event, key) / total for event in events],
        }
    )
    return top.set_index("operator").round(3), trace_path


@releasing
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
        "checkpointing": relative(gradients(densenet(device, checkpointed=True).eval())[0], reference),
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


@releasing
def input_pipeline(split, device, batch: int, image_size: int, steps: int, precision: str, workers) -> list[Measured]:
    """The training step fed by a ``DataLoader`` over ``split`` with each number of ``workers``, then at the most
    workers with pinned memory (GPUs) and with a deeper prefetch."""

    def fed(loader_workers: int, pin_memory: bool = False, prefetch_factor: int | None = None):
        data = torch.utils.data.DataLoader(
            tu.ChestXrayDataset(split, tu.train_transform(image_size)),
            batch_size=batch, shuffle=True, drop_last=True, num_workers=loader_workers, pin_memory=pin_memory,
            prefetch_factor=prefetch_factor if loader_workers else None, persistent_workers=loader_workers > 0,
        )  # fmt: skip
        batches = (
            (tu.to_model_input(images, device), labels)
            for images, labels, _ in itertools.chain.from_iterable(itertools.repeat(data))
        )
        return training_step(densenet(device), batches, precision)

    rows = [measure("input pipeline", f"{n} workers", fed(n), batch, steps, device, workers=n) for n in workers]
    most = max(workers)
    if device.type == "cuda":
        rows.append(measure("input pipeline", f"{most} workers, pinned", fed(most, True), batch, steps, device))
    if most:
        rows.append(measure("input pipeline", f"{most} workers, prefetch 4", fed(most, prefetch_factor=4), batch, steps,
                            device))  # fmt: skip
    return rows


@releasing
def in_ram(device, batch: int, image_size: int, steps: int, precision: str) -> Measured:
    """The baseline every technique is compared with: the plain step on one batch held in device memory."""
    step = training_step(densenet(device), itertools.repeat(random_batch(batch, image_size, device)), precision)
    return measure("baseline", "in RAM", step, batch, steps, device)


def sweep_step(device, image_size: int, precision: str):
    """``make_step(batch)`` for :func:`sweep_batches`: the plain step at each batch."""
    return lambda b: training_step(densenet(device), itertools.repeat(random_batch(b, image_size, device)), precision)
