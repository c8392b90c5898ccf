"""One strategy measured in one process of a launch: losses, memory held and peak, collectives, seconds per step.

``PyTorch_Sharded``'s launched script runs :func:`measure` for every strategy in every process and gathers them.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist

from common.pytorch.sharded.comm import CollectiveLog, backend_calls, summarize
from common.pytorch.sharded.formula import (
    fsdp2_bytes,
    padding_bytes,
    paper_bytes,
    textbook_comm_bytes,
    tp_bytes,
    tp_comm_bytes,
)
from common.pytorch.sharded.memory import cpu_peak_increment, held_bytes, profiled_step, step_peak, storage_bytes
from common.pytorch.sharded.model import MLPShape
from common.pytorch.sharded.training import build, default_device, global_batch_for, global_loss, local_rows
from common.pytorch.sharded.training import train_step as one_step

WARMUP_STEPS = 2  # DDP rebuilds its buckets in its second step (and broadcasts their layout): measure after it


def measure(
    strategy: str,
    shape: MLPShape,
    *,
    global_batch: int,
    seed: int = 0,
    timed_steps: int = 5,
    tensor_parallel: int | None = None,
    device: torch.device | None = None,
) -> dict:
    """Train ``strategy`` with Adam for ``WARMUP_STEPS + 2 + timed_steps`` steps (one more on a GPU); measure them.

    In order: the warm-up steps; one profiled step (CPU memory peak and the backend's calls; on a GPU the
    allocator's peak instead of the CPU one); one step under :class:`~.CollectiveLog`, which also records
    the bytes of the parameters the model has registered between its forward and backward
    (``held_bytes["parameters_after_forward"]``: FSDP2 registers the gathered, whole parameters there when it
    keeps them for backward, the shards otherwise); the model state held after that step
    (:func:`~.held_bytes`); then ``timed_steps`` timed steps. Every step's global loss is kept.
    Each step's gradients are released before it starts (``zero_grad(set_to_none=True)``), so its peak
    includes building them. Returns a JSON-ready dict.
    """
    device = device or default_device()
    model, optimizer, mesh = build(
        strategy, shape, seed=seed, device=device, optimizer="adam", tensor_parallel=tensor_parallel
    )
    rows = local_rows(mesh, global_batch)
    step_number = 0
    losses, local_losses = [], []

    def step(after_forward=None):
        nonlocal step_number
        features, labels = (t[rows].to(device) for t in global_batch_for(step_number, shape, global_batch, seed))
        step_number += 1
        local_losses.append(one_step(model, optimizer, features, labels, after_forward))

    after_forward = {}

    def registered_parameters(module):
        after_forward["parameters"] = storage_bytes(module.parameters())

    def finish():  # the global loss needs a collective of its own: outside the measured region
        losses.extend(global_loss(loss) for loss in local_losses)
        local_losses.clear()

    for _ in range(WARMUP_STEPS):
        step()
    finish()
    optimizer.zero_grad(set_to_none=True)
    peak = step_peak(step, device) if device.type == "cuda" else None
    optimizer.zero_grad(set_to_none=True)
    prof = profiled_step(step)
    finish()
    optimizer.zero_grad(set_to_none=True)
    with CollectiveLog() as log:
        step(registered_parameters)
    finish()
    held = held_bytes(model, optimizer) | {"parameters_after_forward": after_forward["parameters"]}
    if peak is None:
        increment = cpu_peak_increment(prof)
        at_start = held["parameters"] + held["optimizer_state"] + held["ddp_buckets"]  # gradients were released
        peak = {"before": at_start, "peak": at_start + increment, "increment": increment, "source": "torch.profiler"}
    seconds = _seconds_per_step(step, timed_steps, device)
    finish()
    world = dist.get_world_size()
    return {
        "strategy": strategy,
        "rank": dist.get_rank(),
        "processes": world,
        "mesh": dict(zip(mesh.mesh_dim_names, mesh.mesh.shape)),
        "device": str(device),
        "shape": dataclasses.asdict(shape) | {"parameters": shape.parameters},
        "global_batch": global_batch,
        "local_batch": rows.stop - rows.start,
        "losses": losses,
        "held_bytes": held,
        "expected_bytes": expected_bytes(strategy, shape, mesh),
        "step_peak_bytes": peak,
        "collectives": summarize(log.calls),
        "textbook_sent_bytes": textbook_sent_bytes(strategy, shape, mesh, global_batch),
        "backend_calls": backend_calls(prof),
        "seconds_per_step": seconds,
    }


def expected_bytes(strategy: str, shape: MLPShape, mesh) -> dict:
    """The formula's bytes for this process: the ZeRO paper's, and FSDP2's exact at-rest bytes with padding."""
    world = mesh.size()
    if strategy == "tp":
        data, tensor = mesh.mesh.shape
        return {"tp": tp_bytes(shape.linear_sizes, tensor, data)}
    rank = mesh.get_local_rank()
    return {
        "paper": paper_bytes(strategy, shape.parameters, world),
        "fsdp2": fsdp2_bytes(strategy, shape.parameter_shapes, world, rank=rank),
        "padding_per_kind": padding_bytes(shape.parameter_shapes, world) if strategy != "ddp" else 0,
    }


def textbook_sent_bytes(strategy: str, shape: MLPShape, mesh, global_batch: int) -> float:
    """The textbook's bytes one process sends per step for this strategy and mesh (fp32)."""
    if strategy == "tp":
        data, tensor = mesh.mesh.shape
        return tp_comm_bytes(shape.linear_sizes, global_batch // data, tensor)
    return textbook_comm_bytes(strategy, shape.parameters, mesh.size())


def _seconds_per_step(step, steps: int, device: torch.device) -> float:
    """Mean seconds per step over ``steps`` steps, all processes starting together."""
    if steps < 1:
        return float("nan")
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    return (time.perf_counter() - start) / steps
