"""The four ways to spread one model over N processes, each the few lines PyTorch's own tutorials write.

- ``ddp``: ``DistributedDataParallel``: a whole replica per process, gradients all-reduced (DDP tutorial);
- ``zero2``: FSDP2 ``fully_shard(..., reshard_after_forward=False)``: parameters, gradients and optimizer state
  sharded at rest, but each layer's gathered parameters kept from its forward until its backward;
- ``zero3``: FSDP2 ``fully_shard(...)`` with ``reshard_after_forward=True``: gathered parameters freed after each
  layer's forward and gathered again for its backward (FSDP2 tutorial);
- ``tp``: tensor parallelism on the ``tp`` axis of a 2-D mesh (``parallelize_module``), FSDP on its ``dp``
  axis (the 2-D "TP + FSDP" tutorial).

FSDP2 is applied layer by layer and then to the root, as the FSDP2 tutorial does with transformer blocks: each
Linear is one group that is gathered, freed and reduce-scattered on its own, which is what lets ZeRO-3 hold only
one layer's full parameters at a time.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.parallel import DistributedDataParallel

from common.errors import InputError

STRATEGIES = ("ddp", "zero2", "zero3", "tp")


def check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise InputError(f"Unknown strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}.")


def make_mesh(strategy: str, world_size: int, device_type: str, tensor_parallel: int | None = None) -> DeviceMesh:
    """The device mesh of ``strategy``: 1-D ``("dp",)`` for data parallelism, 2-D ``("dp", "tp")`` for ``tp``.

    ``tp`` puts ``tensor_parallel`` processes (all of them by default) on the tensor axis and the rest on the data
    axis: with 2 processes the mesh is 1 x 2, with one process 1 x 1 (a "tensor parallelism" that splits nothing,
    which runs and is useful as the baseline). Every process calls this with the same arguments.
    """
    check_strategy(strategy)
    if strategy != "tp":
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp",))
    tensor_parallel = tensor_parallel or world_size
    if tensor_parallel < 1 or world_size % tensor_parallel:
        raise InputError(
            f"Tensor parallelism over {tensor_parallel} of {world_size} processes: the mesh is data x tensor, "
            f"so the tensor-parallel size must divide the number of processes ({world_size})."
        )
    return init_device_mesh(device_type, (world_size // tensor_parallel, tensor_parallel), mesh_dim_names=("dp", "tp"))


def wrap(strategy: str, model: nn.Module, mesh: DeviceMesh, plan: dict | None = None) -> nn.Module:
    """``model`` (already on this process's device) spread over ``mesh`` by ``strategy``; ``plan`` only for ``tp``."""
    check_strategy(strategy)
    if strategy == "ddp":
        return replicate(model, mesh)
    if strategy == "zero2":
        return shard(model, mesh, reshard_after_forward=False)
    if strategy == "zero3":
        return shard(model, mesh, reshard_after_forward=True)
    if plan is None:
        raise InputError("Tensor parallelism needs a plan: pass plan=tp_plan(shape).")
    return tensor_parallel(model, mesh, plan)


def replicate(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """DDP, as in PyTorch's DDP tutorial: every process holds the whole model, its gradients and its Adam state.

    DDP also keeps its own flat copy of the gradients in the buckets it all-reduces (4Ψ bytes in fp32) unless
    ``gradient_as_bucket_view=True``; left at the default here, as the tutorial leaves it.
    """
    device_ids = [torch.cuda.current_device()] if mesh.device_type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, process_group=mesh.get_group())


def shard(model: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool) -> nn.Module:
    """FSDP2, as in its tutorial: each layer, then the root; the one argument that makes ZeRO-2 or ZeRO-3.

    ``reshard_after_forward=False`` keeps each layer's all-gathered parameters from its forward until its backward
    (no second all-gather, but the whole model unsharded at the start of backward); ``True`` frees them after the
    layer's forward and gathers them again in backward. FSDP2's own default (``None``) means True for every
    layer but False for the root, which here has no parameters of its own. After backward FSDP2 reshards either
    way, so between steps ZeRO-2 and ZeRO-3 hold exactly the same shards.
    """
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


def tensor_parallel(model: nn.Module, mesh: DeviceMesh, plan: dict) -> nn.Module:
    """2-D parallelism, as in PyTorch's TP + FSDP tutorial: the plan on ``mesh["tp"]``, FSDP on ``mesh["dp"]``.

    With one process on the data axis FSDP shards over one rank: it changes nothing and sends nothing, but the
    code is the same as on 2 x 4 GPUs.
    """
    parallelize_module(model, mesh["tp"], plan)
    # FSDP2 warns that a TP layer's output is a view, which an in-place op could detach from FSDP's backward hook.
    # The MLP has no in-place op (its ReLUs are not in place), so the warning is noise here: one per layer per step.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model
