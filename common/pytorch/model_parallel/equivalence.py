"""The pipeline-vs-one-device check: a few fp32 SGD steps through the pipeline and on one device, compared."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from common.pytorch import utils as tu
from common.pytorch.model_parallel.pipeline import bce_loss, random_batch
from common.pytorch.model_parallel.split import STAGES, build_stages, split_densenet

# A few fp32 SGD steps, and the largest difference of the per-step loss allowed. Both sides compute the same
# sums; only the gradient scaling happens at another point (once on the summed micro-batches instead of on each
# loss), so they differ by rounding: not at all when the number of micro-batches is a power of two, about 1e-6
# otherwise. A lost or repeated micro-batch or a wrong gradient scale moves the loss by 1e-3 or more. With
# micro-batches under ~8 images, BatchNorm over a handful of values makes the steps chaotic enough to blow
# rounding up past the tolerance: the check needs real micro-batches.
EQUIVALENCE_STEPS = 3
EQUIVALENCE_LEARNING_RATE = 0.01
EQUIVALENCE_TOLERANCE = 1e-4
# The check runs on noise images this small whatever IMAGE_SIZE is: it tests the schedule, not the data.
EQUIVALENCE_IMAGE_SIZE = 32


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


def check_equivalence(
    process: tu.Process,
    gpipe: Callable,
    pipeline_step: Callable,
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

    ``gpipe(stage, micro_batches, precision)`` builds this process's schedule and ``pipeline_step(schedule, images,
    labels)`` runs one batch through it (the mean loss on the last stage): the notebook passes its script's own, so
    the check verifies the code that trains.

    SGD rather than the notebooks' Adam: Adam divides each gradient by its own running size, so where a
    gradient is near zero a rounding difference turns into a whole step of the learning rate in either
    direction, and two correct computations drift apart by far more than rounding.
    """
    index, device = process.rank, process.device
    batches = [random_batch(batch, image_size, seed + 1 + step, device) for step in range(steps)]
    stage = build_stages(seed)[index].to(device)
    initial = [p.detach().clone() for p in stage.parameters()]
    optimizer = torch.optim.SGD(stage.parameters(), lr=learning_rate)
    schedule = gpipe(stage, micro_batches, "fp32")

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
            pipeline_losses.append(pipeline_step(schedule, images, labels))
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


def merge_equivalence(per_rank: list[dict]) -> dict:
    """One summary of :func:`check_equivalence` from both processes, with the tolerance it is held to."""
    last = per_rank[-1]
    merged = {key: value for key, value in last.items() if key != "stage"}
    for key in ("max_abs_parameter_difference", "max_abs_parameter_update"):
        merged[key] = max(found[key] for found in per_rank)
    merged["tolerance"] = EQUIVALENCE_TOLERANCE
    return merged
