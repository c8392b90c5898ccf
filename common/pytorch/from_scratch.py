"""What ``DataParallel_From_Scratch`` needs besides the lesson itself: a small model, one batch that every process
can build, and the measurements that compare processes.

The lesson (the hand-written all-reduce, BatchNorm over the global batch, DDP for contrast) is on the notebook's page,
in its launched script; this module holds what would only distract from it there.
"""

from __future__ import annotations

import pandas as pd
import torch
import torch.distributed as dist
from torch import nn

from common.errors import InputError
from common.run import params
from common.run.params import NUM_CLASSES

# The equivalence checks' own small sizes: one step of each way, compared to one process, in well under a second
CHECK_BATCH = 8
CHECK_IMAGE_SIZE = 32
# The exercises' parameters: the default (plain data parallelism), then every value allowed.
OPTIONS = (
    ("GRADIENTS", "average", ("average", "sum", "local")),
    ("SAME_INITIAL_WEIGHTS", True, (True, False)),
    ("SET_EPOCH", True, (True, False)),
    ("BATCH_NORM", "local", ("local", "global")),
)


def small_cnn(norm_layer=nn.BatchNorm2d, width: int = 32, num_classes: int = NUM_CLASSES) -> nn.Sequential:
    """Four conv-BatchNorm-ReLU-pool blocks and a linear head (about 240,000 parameters at ``width`` 32): small enough
    that a laptop trains it on ChestX-ray14's stand-in in seconds, with BatchNorm, so that what data parallelism does to
    BatchNorm shows. ``norm_layer(channels)`` builds each BatchNorm."""

    def block(inputs: int, outputs: int) -> list[nn.Module]:
        return [nn.Conv2d(inputs, outputs, 3, padding=1, bias=False), norm_layer(outputs), nn.ReLU(), nn.MaxPool2d(2)]

    channels = [3, width, 2 * width, 4 * width, 4 * width]
    blocks = [layer for inputs, outputs in zip(channels, channels[1:]) for layer in block(inputs, outputs)]
    return nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels[-1], num_classes))


def random_batch(batch: int, image_size: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of noise images (uint8 gray, as the loaders send them) and random labels on ``device``, the same in
    every process that asks with the same seed."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (batch, 1, image_size, image_size), dtype=torch.uint8, generator=generator)
    labels = torch.randint(0, 2, (batch, NUM_CLASSES), generator=generator).float()
    return images.to(device), labels.to(device)


def share(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Process ``rank``'s equal share of a global batch: the rows a DistributedSampler would give it, in order."""
    size = len(tensor) // world_size
    return tensor[rank * size : (rank + 1) * size]


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter and buffer (BatchNorm's running statistics included)."""
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def largest_difference(first: dict, second: dict, buffers: bool = True) -> float:
    """The largest absolute difference between two :func:`state` copies (``buffers=False``: the trained weights
    only, not BatchNorm's running statistics)."""
    names = [name for name in first if buffers or "running" not in name and "num_batches" not in name]
    return max((first[name].float() - second[name].float()).abs().max().item() for name in names)


def largest_change(before: dict, after: dict) -> float:
    """How far a step moved the weights: a check that equal weights after the step are not trivially equal."""
    return largest_difference(before, after, buffers=False)


def apart_from_rank0(tensors) -> float:
    """The largest absolute difference between this process's ``tensors`` (a model's parameters, a buffer) and rank
    0's, the same in every process: 0.0 while the copies are in step."""
    flat = torch.cat([tensor.detach().reshape(-1) for tensor in tensors])
    first = flat.clone()
    dist.broadcast(first, src=0)
    apart = (flat - first).abs().max()
    dist.all_reduce(apart, op=dist.ReduceOp.MAX)
    return apart.item()


def ddp_buckets(ddp_model) -> dict:
    """How DDP groups the gradients it all-reduces: the bucket sizes in bytes (in the order they are reduced, the last
    layers' first) and the cap, from DDP's own logging data."""
    found = ddp_model._get_ddp_logging_data()
    sizes = [int(size) for size in str(found.get("bucket_sizes", "")).split(",") if size.strip()]
    return {"bucket_bytes": sizes, "bucket_cap_bytes": int(found.get("bucket_cap_bytes", 0))}


def check_parameters(**given) -> str:
    """Refuse what this notebook cannot do, naming the fix; return the exercises' parameters that ``given`` changes
    from their defaults, as ``"NAME='value'"`` (``""`` when none)."""
    if given["PRECISION"] != "fp32":
        raise InputError(
            f"PRECISION={given['PRECISION']!r}: this notebook teaches data parallelism in fp32; set PRECISION = "
            "'fp32' (PyTorch_Speedups teaches mixed precision)."
        )
    params.check_not_pretrained(given["PRETRAINED"], "the small network of this notebook has no pretrained weights")
    changed = []
    for name, default, allowed in OPTIONS:
        if params.check_choice(name, given[name], allowed) != default:
            changed.append(f"{name}={given[name]!r}")
    return ", ".join(changed)


def check_table(found: dict) -> pd.DataFrame:
    """The check's comparisons (what the launched script's ``check`` found) as a table; prints the step's size and
    DDP's buckets."""
    buckets = found["bucket_bytes"]
    print(
        f"step size (the largest change of a weight in one step): {found['step_size']:.3g}; DDP reduced "
        f"{found['gradient_bytes']:,} bytes of gradients in {len(buckets)} bucket(s) of {buckets} bytes "
        f"(cap {found['bucket_cap_bytes']:,})"
    )
    rows = {
        "by hand (all_reduce, divide)": ("one process, whole batch", found["by_hand_vs_one_process"]),
        "DDP": ("by hand", found["ddp_vs_by_hand"]),
        "by hand, local BatchNorm": ("one process, whole batch", found["local_batch_norm_vs_one_process"]),
        "by hand, global BatchNorm": ("one process, whole batch", found["global_batch_norm_vs_one_process"]),
        "DDP: BatchNorm statistics before forward": ("rank 0's", found["ddp_buffers_apart_before_forward"]),
        "DDP: BatchNorm statistics after the step": ("rank 0's", found["ddp_buffers_apart_after_step"]),
    }
    table = pd.DataFrame.from_dict(rows, orient="index", columns=["against", "largest difference"])
    table["in steps"] = table["largest difference"] / found["step_size"]
    table.index.name = "one step"
    return table
