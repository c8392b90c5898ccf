"""One DenseNet-121 cut into two stages: naive model parallelism, a GPipe pipeline, and how to measure them.

Used by ``PyTorch_ModelParallel`` and its training script. The model is cut between dense blocks, where a
single tensor crosses the cut, so each stage is an ordinary ``nn.Module`` and a pipeline only ever sends that
tensor forward and its gradient back.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import os
import time
from collections import OrderedDict

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.optim.swa_utils import update_bn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from common import monitor
from common import torch_training as tt
from common import torch_utils as tu
from common.devices import threads_per_device
from common.errors import InputError
from common.params import NUM_CLASSES

# Stage 0 ends with transition2, stage 1 starts at denseblock3. Only a 256-channel map at 1/16 of the image
# size crosses the cut (16 KiB per 64-px image in fp32), and no earlier layer's output is needed after it.
SPLIT_AT = "denseblock3"
STAGES = 2  # pipeline and naive model parallelism here use exactly two devices
# The pipeline-vs-single-device check: a few fp32 SGD steps, and the largest difference of the per-step loss
# allowed. Both sides compute the same sums; only the gradient scaling happens at another point (once on the
# summed micro-batches instead of on each loss), so they differ by rounding: not at all when the number of
# micro-batches is a power of two, about 1e-6 otherwise. A lost or repeated micro-batch or a wrong gradient scale
# moves the loss by 1e-3 or more. With micro-batches under ~8 images, BatchNorm over a handful of values makes the
# steps chaotic enough to blow rounding up past the tolerance: the check needs real micro-batches.
EQUIVALENCE_STEPS = 3
EQUIVALENCE_LEARNING_RATE = 0.01
EQUIVALENCE_TOLERANCE = 1e-4
# The check runs on noise images this small whatever IMAGE_SIZE is: it tests the schedule, not the data.
EQUIVALENCE_IMAGE_SIZE = 32


class Stage(nn.Module):
    """A run of DenseNet-121's ``features``, and on the last stage the head (ReLU, global pool, classifier).

    The submodules keep the names they have in the whole model, so the stages' state dicts together are
    exactly the whole model's state dict (see :func:`merge_states`).
    """

    def __init__(self, model: nn.Module, names: list[str], head: bool):
        super().__init__()
        self.features = nn.Sequential(OrderedDict((name, getattr(model.features, name)) for name in names))
        self.classifier = model.classifier if head else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        if self.classifier is None:
            return x
        # the tail of torchvision's DenseNet.forward, step for step, so the two stages equal the whole model
        x = F.relu(x, inplace=True)
        x = F.adaptive_avg_pool2d(x, (1, 1))
        return self.classifier(torch.flatten(x, 1))


def split_densenet(model: nn.Module, at: str = SPLIT_AT) -> list[Stage]:
    """Two stages that share ``model``'s parameters: ``features`` before ``at``, and the rest with the head."""
    names = [name for name, _ in model.features.named_children()]
    if at not in names[1:]:
        raise ValueError(f"cannot split DenseNet-121 at {at!r}: choose one of {names[1:]}")
    cut = names.index(at)
    return [Stage(model, names[:cut], head=False), Stage(model, names[cut:], head=True)]


def parameters_per_stage(stages) -> list[int]:
    return [tu.trainable_parameters(stage) for stage in stages]


def merge_states(states) -> dict[str, torch.Tensor]:
    """The whole model's state dict from the stages' (on the CPU); the stages must not overlap."""
    merged = {}
    for state in states:
        overlap = merged.keys() & state.keys()
        if overlap:
            raise ValueError(f"stages overlap in {sorted(overlap)[:3]}")
        merged.update({name: value.cpu() for name, value in state.items()})
    return merged


def build_stages(seed: int, pretrained: bool = False) -> list[Stage]:
    """The stages of a freshly built DenseNet-121; the same seed gives every process the same initial weights."""
    torch.manual_seed(seed)
    return split_densenet(tu.build_densenet121(pretrained=pretrained))


class NaiveModelParallel(nn.Module):
    """Each stage on its own device, run one after the other in one process.

    The activation is copied from one device to the next at the cut; while one device computes, the other
    waits, so two devices give the memory of two but the speed of one (less, counting the copies).
    """

    def __init__(self, stages, devices):
        super().__init__()
        self.devices = [torch.device(device) for device in devices]
        self.stages = nn.ModuleList(stage.to(device) for stage, device in zip(stages, self.devices))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage, device in zip(self.stages, self.devices):
            x = stage(x.to(device, non_blocking=True))
        return x


class Autocast(nn.Module):
    """Runs a stage under ``tu.autocast``: the pipeline schedule calls the stage, so the context must be inside."""

    def __init__(self, module: nn.Module, precision: str, device: torch.device):
        super().__init__()
        self.module, self.precision, self.device = module, precision, device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with tu.autocast(self.precision, self.device):
            return self.module(x)


def bce_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean binary cross-entropy of every notebook, computed in fp32 whatever the precision of the logits."""
    return F.binary_cross_entropy_with_logits(logits.float(), labels)


def gpipe(
    stage: nn.Module, index: int, device: torch.device, micro_batches: int, precision: str = "fp32"
) -> ScheduleGPipe:
    """This process's stage of a two-stage GPipe pipeline (all forwards, then all backwards).

    Each micro-batch's loss is a mean over its images, and the schedule divides the summed gradients by the
    number of micro-batches, so a step's gradient is the mean over the whole batch, as on one device.
    """
    wrapped = Autocast(stage, precision, device) if precision == "mixed" else stage
    pipeline_stage = PipelineStage(wrapped, index, STAGES, device)
    return ScheduleGPipe(pipeline_stage, n_microbatches=micro_batches, loss_fn=bce_loss, scale_grads=True)


def pipeline_step(schedule: ScheduleGPipe, index: int, images: torch.Tensor | None, labels: torch.Tensor | None):
    """Forward and backward of one batch through the pipeline; the mean loss on the last stage, else None.

    The first stage needs only the images, the last only the labels: the activations arrive from the other.
    """
    if index == 0:
        schedule.step(images)
        return None
    losses = []
    schedule.step(target=labels, losses=losses, return_outputs=False)
    return torch.stack([loss.detach() for loss in losses]).mean()


def accumulated_step(model: nn.Module, optimizer, images, labels, micro_batches: int) -> torch.Tensor:
    """One single-device step over the same micro-batches as the pipeline, gradients averaged as GPipe does.

    BatchNorm normalizes each micro-batch by its own statistics in both, which a full-batch step would not.
    """
    optimizer.zero_grad(set_to_none=True)
    losses = []
    for x, y in zip(images.chunk(micro_batches), labels.chunk(micro_batches)):
        loss = bce_loss(model(x), y)
        (loss / micro_batches).backward()
        losses.append(loss.detach())
    optimizer.step()
    return torch.stack(losses).mean()


def random_batch(batch: int, image_size: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed batch of noise images and 0/1 labels, the same in every process that uses the same seed."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, 3, image_size, image_size, generator=generator)
    labels = torch.randint(0, 2, (batch, NUM_CLASSES), generator=generator).float()
    return images.to(device), labels.to(device)


def check_equivalence(
    process: tu.Process,
    *,
    seed: int,
    image_size: int,
    batch: int,
    micro_batches: int,
    steps: int = EQUIVALENCE_STEPS,
    learning_rate: float = EQUIVALENCE_LEARNING_RATE,
) -> dict:
    """``steps`` SGD steps of the fp32 pipeline and of one device on the same micro-batches, from the same weights.

    Run by both pipeline processes. Each also computes the single-device reference (in parallel, so it costs
    no extra time) and compares the weights and BatchNorm statistics of its own stage; the last stage compares
    the losses, and the difference to full-batch steps, where BatchNorm sees the whole batch at once.
    Returns this rank's findings.

    SGD rather than the notebooks' Adam: Adam divides each gradient by its own running size, so where a
    gradient is near zero a rounding difference turns into a whole step of the learning rate in either
    direction, and two correct computations drift apart by far more than rounding.
    """
    index, device = process.rank, process.device
    batches = [random_batch(batch, image_size, seed + 1 + step, device) for step in range(steps)]
    stage = build_stages(seed)[index].to(device)
    initial = [p.detach().clone() for p in stage.parameters()]
    optimizer = torch.optim.SGD(stage.parameters(), lr=learning_rate)
    schedule = gpipe(stage, index, device, micro_batches)

    def reference(micro: int):
        torch.manual_seed(seed)
        model = tu.build_densenet121().to(device)
        reference_optimizer = torch.optim.SGD(model.parameters(), lr=learning_rate)
        losses = [accumulated_step(model, reference_optimizer, *b, micro) for b in batches]
        return model, [loss.item() for loss in losses]

    with exact_arithmetic():
        pipeline_losses = []
        for images, labels in batches:
            optimizer.zero_grad(set_to_none=True)
            pipeline_losses.append(pipeline_step(schedule, index, images, labels))
            optimizer.step()
        model, reference_losses = reference(micro_batches)
        full_batch_losses = reference(1)[1] if index == STAGES - 1 else None
    ours = split_densenet(model)[index].state_dict()
    found = {
        "stage": index,
        "steps": steps,
        "micro_batches": micro_batches,
        "image_size": image_size,
        "optimizer": f"SGD lr={learning_rate:g}",
        "max_abs_parameter_difference": max(  # weights and BatchNorm statistics; not the integer step counts
            (value - ours[name]).abs().max().item()
            for name, value in stage.state_dict().items()
            if value.is_floating_point()
        ),
        # how far the weights moved: agreement after steps that changed nothing would prove nothing
        "max_abs_parameter_update": max((p - q).abs().max().item() for p, q in zip(stage.parameters(), initial)),
    }
    if index == STAGES - 1:
        losses = [loss.item() for loss in pipeline_losses]
        found.update(
            pipeline_losses=losses,
            single_device_losses=reference_losses,
            max_abs_loss_difference=max(abs(a - b) for a, b in zip(losses, reference_losses)),
            full_batch_losses=full_batch_losses,
            max_abs_loss_difference_to_full_batch=max(abs(a - b) for a, b in zip(losses, full_batch_losses)),
        )
    return found


@contextlib.contextmanager
def exact_arithmetic():
    """On GPUs: fp32 without TF32, and the same convolution algorithm every time, then the settings as they were.

    The equivalence check compares two computations down to rounding; TF32 rounds to 10 bits, and cuDNN's
    autotuner may pick another algorithm for each side.
    """
    backends = torch.backends
    saved = (
        backends.cudnn.allow_tf32,
        backends.cuda.matmul.allow_tf32,
        backends.cudnn.benchmark,
        backends.cudnn.deterministic,
    )
    backends.cudnn.allow_tf32 = backends.cuda.matmul.allow_tf32 = backends.cudnn.benchmark = False
    backends.cudnn.deterministic = True
    try:
        yield
    finally:
        (
            backends.cudnn.allow_tf32,
            backends.cuda.matmul.allow_tf32,
            backends.cudnn.benchmark,
            backends.cudnn.deterministic,
        ) = saved


def labels_loader(split, batch_size: int, seed: int) -> DataLoader:
    """The labels of ``split`` in the order a shuffled single-process ``sharded_loader`` reads the images.

    The last pipeline stage needs only the labels: the same sampler (same seed, same epoch) gives the same
    batches without decoding a single image.
    """
    data = TensorDataset(torch.as_tensor(split.labels).float(), torch.arange(len(split)))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=seed, drop_last=False)
    return DataLoader(data, batch_size=batch_size, sampler=sampler, drop_last=True)


def single_process(device: torch.device) -> tu.Process:
    """A process that trains on its own, as rank 0 of a world of one: its loaders read the whole data set."""
    return tu.Process(0, 1, 0, device)


def independent_process() -> tu.Process:
    """One process of a ``torchrun`` launch that trains alone: its own GPU (or its share of the cores), no group.

    ``torchrun`` is only the launcher here: it starts the processes together, streams their output and
    fails if any fails; the processes never talk to each other.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or threads_per_device(1)))
    return tu.Process(0, 1, local_rank, device)


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


def stage_seconds(stages, images: torch.Tensor, labels: torch.Tensor, precision: str, repeats: int = 2) -> list[float]:
    """Forward and backward seconds of each stage on the whole batch, on the batch's device.

    Parameters say how much memory a stage needs; these times say how much work: the pipeline runs at the
    pace of the slower stage.
    """
    seconds = []
    for index, stage in enumerate(stages):
        x = stage_input(stages, index, images)
        stage.to(images.device)
        step = stage_alone_step(stage, index, x, labels, 1, precision)
        seconds.append(seconds_per_step(step, repeats, [images.device], together=False, warmup=1))
        stage.zero_grad(set_to_none=True)
    return seconds


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


def check_devices(hardware) -> None:
    """Model parallelism splits one model over two devices: refuse fewer before anything trains."""
    if hardware.count >= STAGES:
        return
    if hardware.available >= STAGES:
        fix = "set DEVICES to 2 or more, or to None"
    elif hardware.kind == "gpu":
        fix = "use a machine with 2 or more GPUs"
    else:
        fix = "use a machine with 2 or more cores, or with GPUs"
    raise InputError(
        f"Model parallelism needs 2 devices, but this run has {hardware.count} ({hardware.describe()}): {fix}."
    )


def check_micro_batches(micro_batches, global_batch: int, name: str = "MICRO_BATCHES") -> tuple[int, ...]:
    """Every micro-batch count must split the global batch evenly: GPipe averages micro-batch means."""
    values = (micro_batches,) if isinstance(micro_batches, int) else tuple(micro_batches or ())
    if not values:
        raise InputError(f"{name} is empty: give at least one number of micro-batches, e.g. (1, 2, 4).")
    for m in values:
        if isinstance(m, bool) or not isinstance(m, int) or m < 1 or global_batch % m:
            raise InputError(
                f"{name} contains {m!r}, which does not divide the global batch of {global_batch} evenly: "
                f"use divisors of {global_batch} (for example 1, 2, 4) or change BATCH_SIZE_PER_DEVICE."
            )
    return values


def check_precision(precision: str, hardware) -> None:
    """Mixed precision must mean bfloat16: float16 needs loss scaling, which the pipeline schedule does not do."""
    if precision == "mixed" and hardware.kind == "gpu" and not torch.cuda.is_bf16_supported():
        raise InputError(
            "PRECISION='mixed' means float16 on this GPU, which needs loss scaling that the pipeline schedule "
            "does not apply: set PRECISION='fp32', or use a GPU with bfloat16 (Ampere or newer)."
        )


def sweep_learning_rates(base: float, count: int, given=None) -> list[float]:
    """One learning rate per device: ``given``, or the base rate and its doublings and halvings around it."""
    if given is not None:
        rates = list(given)
        if len(rates) != count or not all(isinstance(r, int | float) and r > 0 for r in rates):
            raise InputError(
                f"LEARNING_RATES={given!r}: give one positive learning rate per device ({count}), "
                f"or None for {sweep_learning_rates(base, count)}."
            )
        return [float(r) for r in rates]
    factors = [1.0]
    while len(factors) < count:
        factors.append(2.0 ** (len(factors) // 2 + 1) if len(factors) % 2 else 0.5 ** (len(factors) // 2))
    return sorted(base * f for f in factors)


def window(frame: pd.DataFrame, start: float, end: float) -> pd.DataFrame:
    """The monitor samples taken between ``start`` and ``end`` seconds after the monitor started."""
    return frame[(frame["seconds"] >= start) & (frame["seconds"] <= end)]


def utilization(frame: pd.DataFrame, start: float, end: float) -> dict:
    """Mean utilization and peak memory per device over one measured phase."""
    return monitor.summarize(window(frame, start, end))


def evaluate_assembled(
    model: nn.Module,
    splits,
    *,
    image_size: int,
    batch: int,
    precision: str,
    seed: int,
    batch_norm_batches: int,
    device: torch.device,
    workers: int = 0,
):
    """Precise BN from training batches, then sigmoid scores and labels of every test image once, in order.

    Runs in the notebook's own process on one device: the assembled model is an ordinary DenseNet-121 again.
    """
    process = single_process(device)
    model.to(device).train()
    train = tt.sharded_loader(
        splits["train"], tu.train_transform(image_size), batch, process, shuffle=True, seed=seed, workers=workers
    )
    with torch.no_grad():
        update_bn(itertools.islice(train, batch_norm_batches), model, device)
    test = tt.sharded_loader(
        splits["test"], tu.eval_transform(image_size), batch, process, shuffle=False, seed=seed, workers=workers
    )
    return tu.predict_all(model, test, process, precision)


def device_names(kind: str, count: int) -> list[str]:
    """Names that tell devices apart in a record: ``cuda:i``, or ``cpu:i`` for the simulated ones."""
    return [f"{'cuda' if kind == 'gpu' else 'cpu'}:{i}" for i in range(count)]


def not_measured(kind: str, variant: str) -> dict[str, str]:
    """What this run could not measure for ``variant``, and why: what only GPUs show."""
    if kind == "gpu":
        return {}
    missing = {
        "peak_memory_mib_per_device": "the simulated CPU devices share one RAM and PyTorch keeps no peak per CPU "
        "device; device_utilization has the memory of the whole machine",
        "utilization_per_device": "the monitor sees all CPU cores as one device 'cpu'",
    }
    if variant.startswith("naive"):
        missing["activation_copy_seconds"] = (
            "both simulated devices are the same RAM, so moving the activation to the next device costs nothing here"
        )
    if variant.startswith("pipeline"):
        missing["gpu_to_gpu_transfer"] = (
            "the stages exchange activations through gloo over local TCP here; NCCL over NVLink or PCIe needs GPUs"
        )
    return missing


def merge_equivalence(per_rank: list[dict]) -> dict:
    """One summary of :func:`check_equivalence` from both processes, with the tolerance it is held to."""
    last = per_rank[-1]
    merged = {key: value for key, value in last.items() if key != "stage"}
    for key in ("max_abs_parameter_difference", "max_abs_parameter_update"):
        merged[key] = max(found[key] for found in per_rank)
    merged["tolerance"] = EQUIVALENCE_TOLERANCE
    return merged


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


def extra_fields(entry: dict) -> dict:
    """The fields of a benchmark entry that its record keeps beyond the shared ones."""
    keep = ("seconds_per_step", "micro_batches", "bubble", "stage_alone_seconds", "stage_step_seconds")
    return {key: entry[key] for key in keep if key in entry}


def benchmark_table(benchmark: dict[str, dict]) -> pd.DataFrame:
    """Images/s, speed-up over one device, and the most parameters and memory any one device holds."""
    single = benchmark["single-device"]["images_per_second"]
    rows = {}
    for variant, entry in benchmark.items():
        memory = entry["peak_memory_mib_per_device"]
        bubble = entry.get("bubble", {}).get("measured")
        rows[variant] = {
            "devices": len(entry["parameters_per_device"]),
            "images/s": entry["images_per_second"],
            "x one device": entry["images_per_second"] / single,
            "most parameters on a device": max(entry["parameters_per_device"].values()),
            "most peak memory on a device (MiB)": max(memory.values()) if memory else None,
            "utilization % per monitored device": ", ".join(
                f"{name} {found['utilization_mean_percent']:.0f}"
                for name, found in entry.get("utilization", {}).items()
            ),
            "bubble per stage": ", ".join(f"{b:.2f}" for b in bubble) if bubble else "",
        }
    return pd.DataFrame.from_dict(rows, orient="index")


def bubble_table(benchmark: dict[str, dict]) -> pd.DataFrame:
    """Measured bubble of each stage and the textbook value, one row per number of micro-batches."""
    rows = []
    for entry in benchmark.values():
        if "bubble" in entry:
            bubble = entry["bubble"]
            row = {"micro-batches": bubble["micro_batches"], "textbook": bubble["textbook"]}
            row.update({f"stage {i} measured": value for i, value in enumerate(bubble["measured"])})
            rows.append(row)
    return pd.DataFrame(rows).sort_values("micro-batches").reset_index(drop=True)


def advice(benchmark: dict, stage_parameters, stage_seconds, sweep: pd.DataFrame, kind: str) -> list[str]:
    """'When to choose which', from this run's numbers: speed, parameter split, bubble, balance, sweep, GPU-only."""
    rate = {variant: entry["images_per_second"] for variant, entry in benchmark.items()}
    single, ddp, naive = rate["single-device"], rate["ddp"], rate["naive-model-parallel"]
    pipelines = {
        entry["micro_batches"]: entry["images_per_second"] for entry in benchmark.values() if "bubble" in entry
    }
    best_m = max(pipelines, key=pipelines.get)
    best = pipelines[best_m]
    total = sum(stage_parameters)
    names = list(benchmark["naive-model-parallel"]["parameters_per_device"])
    lines = [
        f"Speed on these two devices: DDP {ddp:.1f} images/s ({ddp / single:.2f}x one device), the best pipeline "
        f"(m={best_m}) {best:.1f} ({best / single:.2f}x), naive model parallelism {naive:.1f} ({naive / single:.2f}x)."
    ]
    if ddp >= best:
        lines.append(
            f"When the model and one device's batch fit on one device, choose DDP: {ddp / best:.2f}x the best "
            f"pipeline here, with no bubble and no cut to balance."
        )
    else:
        lines.append(
            f"Here the pipeline beat DDP ({best / ddp:.2f}x). DDP averages the gradients of all {total:,} "
            f"parameters every step, the pipeline sends only activations and idles in its bubble; which costs more "
            f"depends on the interconnect, the batch and, on simulated devices, on the cores the communication "
            f"takes from the computation: measure on the real machine before choosing."
        )
    split = " and ".join(f"{count:,} on {name}" for count, name in zip(stage_parameters, names))
    lines.append(
        f"Model parallelism splits the {total:,} parameters {split} ({max(stage_parameters) / total:.0%} on the "
        f"fuller device, against 100% on every DDP device). Naive model parallelism ran at {naive / single:.2f}x "
        f"one device: it buys that room, not speed, since one device works at a time; pipelining the same split "
        f"ran {best / naive:.2f}x faster than it."
    )
    bubbles = bubble_table(benchmark)
    measured = "; ".join(
        f"m={row['micro-batches']:.0f}: "
        + " / ".join(f"{row[f'stage {i} measured']:.0%}" for i in range(STAGES))
        + f" (textbook {row['textbook']:.0%})"
        for _, row in bubbles.iterrows()
    )
    first, last = bubbles.iloc[0], bubbles.iloc[-1]
    stage_bubbles = [first[f"stage {i} measured"] for i in range(STAGES)]
    busier, lighter = int(np.argmin(stage_bubbles)), int(np.argmax(stage_bubbles))
    mean_first, mean_last = np.mean(stage_bubbles), np.mean([last[f"stage {i} measured"] for i in range(STAGES)])
    trend = "shrank" if mean_last < mean_first else "did not shrink"
    lines.append(
        f"Measured bubble per stage (stage 0 / stage 1): {measured}. The textbook assumes equal stages: at "
        f"m={first['micro-batches']:.0f} the busier stage {busier} idled {stage_bubbles[busier]:.0%} and the lighter "
        f"stage {lighter}, waiting for it, {stage_bubbles[lighter]:.0%}. More micro-batches {trend} the stages' mean "
        f"bubble ({mean_first:.0%} at m={first['micro-batches']:.0f}, {mean_last:.0%} at "
        f"m={last['micro-batches']:.0f}); smaller micro-batches also use a device less efficiently and each adds a "
        f"send and a receive, so the fastest pipeline here had m={best_m}. Choose a pipeline when the model does not "
        f"fit on one device, with several micro-batches per stage, as long as each still keeps a device busy."
    )
    lines.append(
        f"Balance the cut by time, not by parameters: stage 0 holds {stage_parameters[0] / total:.0%} of the "
        f"parameters but took {stage_seconds[0] / sum(stage_seconds):.0%} of the forward and backward time."
    )
    top = sweep.loc[sweep["test AUC"].idxmax()]
    lines.append(
        f"One model per device trained {len(sweep)} models at once in {sweep['seconds'].max():.0f} s, test AUC "
        f"{sweep['test AUC'].min():.3f} to {sweep['test AUC'].max():.3f}, best at learning rate "
        f"{top['learning rate']:g}. Choose it for sweeps, seeds and ensembles: no communication at all, each run "
        f"at one device's speed."
    )
    if kind == "gpu":
        peaks = {
            variant: max(entry["peak_memory_mib_per_device"].values())
            for variant, entry in benchmark.items()
            if entry["peak_memory_mib_per_device"]
        }
        lines.append("Peak memory on the fullest device (MiB): " + ", ".join(f"{v} {p:.0f}" for v, p in peaks.items()))
    else:
        missing = {}
        for variant in benchmark:
            missing.update(not_measured(kind, variant))
        lines.append(
            "Only GPUs measure: "
            + "; ".join(f"{what} ({why})" for what, why in missing.items())
            + ". These CPU numbers show the shape of the trade-offs, not GPU speeds."
        )
    return lines
