"""The step all four strategies train: the same data, the same loss, the same optimizer; and the losses it gives.

Every process draws the whole global batch of a step from the step's own seed and keeps the rows of its
data-parallel rank: under ``ddp``, ``zero2`` and ``zero3`` that is 1/N of the batch, under ``tp`` every process of
a tensor-parallel group trains on the same rows (the group computes one model together). The loss each process
reports is the mean over the data-parallel ranks: the loss of the whole global batch, the same number in every
strategy when they compute the same thing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from common.errors import InputError
from common.pytorch.sharded.model import MLPShape, check_tensor_parallel, tp_plan
from common.pytorch.sharded.wrap import make_mesh, wrap

# The equivalence check trains with plain SGD: its step is proportional to the gradient, so a gradient that is
# summed instead of averaged over the N processes, or counted twice, changes every later loss. Adam divides each
# gradient by its own running size and would hide exactly that error (its steps barely change when every
# gradient is scaled by N). The memory measurements use Adam, whose two moments are the optimizer state ZeRO
# shards; its losses agree as closely.
CHECK_OPTIMIZER = "sgd"
CHECK_LEARNING_RATE = 0.5
ADAM_LEARNING_RATE = 1e-3
# The largest difference of a per-step loss from DDP's that the check allows. Measured on gloo with torch 2.14,
# 2 processes, widths 32 and 1024, 6 steps, SGD and Adam: FSDP2's losses equal DDP's bit for bit (an average
# of two numbers is exact in any order); TP's differ by up to 1.8e-7 (its split matrix products add in another
# order); one process against two, 1.2e-7. A gradient twice too large moves the losses by 2e-4 to 7e-3.
LOSS_TOLERANCE = 1e-6


def make_optimizer(name: str, parameters, learning_rate: float | None = None) -> torch.optim.Optimizer:
    """Adam (what the ZeRO paper counts, and what the memory numbers use) or plain SGD (what the check uses)."""
    if name == "adam":
        return torch.optim.Adam(parameters, lr=learning_rate or ADAM_LEARNING_RATE)
    if name == "sgd":
        return torch.optim.SGD(parameters, lr=learning_rate or CHECK_LEARNING_RATE)
    raise InputError(f"optimizer={name!r}: choose 'adam' or 'sgd'.")


def global_batch_for(step: int, shape: MLPShape, global_batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s whole batch: noise features and 14 labels that a fixed random projection of them decides.

    The labels are learnable (the loss falls), so agreeing losses come from steps that change the model.
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    features = torch.randn(global_batch, shape.in_features, generator=generator)
    projection = torch.randn(shape.in_features, shape.classes, generator=torch.Generator().manual_seed(seed))
    labels = (features @ projection > 0).float()
    return features, labels


def local_rows(mesh, global_batch: int) -> slice:
    """The rows of the global batch this process trains on: its share on the mesh's ``dp`` axis."""
    data = mesh["dp"] if mesh.mesh_dim_names and len(mesh.mesh_dim_names) > 1 else mesh
    size, rank = data.size(), data.get_local_rank()
    if global_batch % size:
        raise InputError(
            f"A global batch of {global_batch} does not split evenly over {size} data-parallel processes: "
            f"choose a multiple of {size}."
        )
    share = global_batch // size
    return slice(rank * share, (rank + 1) * share)


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, features, labels, after_forward=None
) -> torch.Tensor:
    """One step; returns this process's loss, detached (use :func:`global_loss` for the whole batch's).

    ``after_forward(model)``, if given, runs between forward and backward: where ZeRO-2 and ZeRO-3 differ.
    """
    optimizer.zero_grad(set_to_none=True)
    loss = nn.functional.binary_cross_entropy_with_logits(model(features), labels)
    if after_forward is not None:
        after_forward(model)
    loss.backward()
    optimizer.step()
    return loss.detach()


def global_loss(loss: torch.Tensor) -> float:
    """The mean of every process's loss: the global batch's loss (TP ranks of one group add equal copies)."""
    total = loss.clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def build(
    strategy: str,
    shape: MLPShape,
    *,
    seed: int,
    device: torch.device,
    optimizer: str,
    learning_rate: float | None = None,
    tensor_parallel: int | None = None,
):
    """The model built from ``seed``, moved to ``device``, wrapped for ``strategy``; its optimizer; its mesh."""
    world = dist.get_world_size()
    if strategy == "tp":
        check_tensor_parallel(shape, tensor_parallel or world)
    mesh = make_mesh(strategy, world, device.type, tensor_parallel)
    model = wrap(strategy, shape.build(seed).to(device), mesh, plan=tp_plan(shape) if strategy == "tp" else None)
    return model, make_optimizer(optimizer, model.parameters(), learning_rate), mesh


def losses(
    strategy: str,
    steps: int,
    shape: MLPShape,
    *,
    global_batch: int,
    seed: int = 0,
    optimizer: str = CHECK_OPTIMIZER,
    learning_rate: float | None = None,
    tensor_parallel: int | None = None,
    device: torch.device | None = None,
) -> list[float]:
    """The global loss at each of ``steps`` steps of ``strategy``; run by every process of a launch.

    Compare the lists of two strategies with :func:`loss_difference`: equal within :data:`LOSS_TOLERANCE`
    means they trained the same model on the same data.
    """
    device = device or default_device()
    model, opt, mesh = build(
        strategy,
        shape,
        seed=seed,
        device=device,
        optimizer=optimizer,
        learning_rate=learning_rate,
        tensor_parallel=tensor_parallel,
    )
    rows = local_rows(mesh, global_batch)
    found = []
    for step in range(steps):
        features, labels = (t[rows].to(device) for t in global_batch_for(step, shape, global_batch, seed))
        found.append(global_loss(train_step(model, opt, features, labels)))
    return found


def loss_difference(ours: list[float], reference: list[float]) -> float:
    """The largest difference of the per-step losses of two runs of equal length."""
    if len(ours) != len(reference):
        raise ValueError(f"{len(ours)} losses against {len(reference)}: compare runs of the same number of steps.")
    return max(abs(a - b) for a, b in zip(ours, reference))


def default_device() -> torch.device:
    """This process's GPU (``setup_distributed`` has selected it), or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
