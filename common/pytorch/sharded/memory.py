"""Measured memory per process: what the model state occupies between steps, and the peak while a step runs.

Between steps the model state is counted tensor by tensor (:func:`held_bytes`): parameters, gradients and
optimizer state, each a DTensor's local shard where sharded. While a step runs, the device's allocator knows the
peak on a GPU (:func:`step_peak`); on the CPU PyTorch keeps no running total, so the profiler's memory events
are summed instead (:func:`profiled_step`, :func:`cpu_peak_increment`).
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this process holds: a DTensor's local shard, a plain tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def storage_bytes(tensors) -> int:
    """Bytes of the storages behind ``tensors``' local parts, each storage once.

    Storage, not ``numel``: FSDP2's shards are views of zero-padded chunks (see
    :func:`~.formula.fsdp2_bytes`), and the padding is memory the process really holds.
    """
    storages = {}
    for tensor in tensors:
        if tensor is not None:
            storage = local(tensor).untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of model state this process holds now (after a step, before ``zero_grad``), by kind.

    - ``parameters``, ``gradients``: storages of each parameter's and gradient's local shard;
    - ``optimizer_state``: Adam's ``exp_avg`` and ``exp_avg_sq`` (unpadded: made from the local view);
    - ``optimizer_step_counters``: Adam's one-element ``step`` per parameter tensor (the paper ignores them);
    - ``ddp_buckets``: DDP's flat gradient buckets, a second copy of the gradients (0 for the others).

    ``total`` adds the first three, the ZeRO paper's model states.
    """
    parameters = list(model.parameters())
    states = [value for p in parameters for value in optimizer.state.get(p, {}).values() if torch.is_tensor(value)]
    found = {
        "parameters": storage_bytes(parameters),
        "gradients": storage_bytes(p.grad for p in parameters),
        "optimizer_state": storage_bytes(v for v in states if v.dim() > 0),
        "optimizer_step_counters": storage_bytes(v for v in states if v.dim() == 0),
        "ddp_buckets": ddp_bucket_bytes(model),
    }
    found["total"] = found["parameters"] + found["gradients"] + found["optimizer_state"]
    return found


def ddp_bucket_bytes(model: nn.Module) -> int:
    """Bytes of DDP's gradient buckets, as DDP's own logging data reports them (after its first backward)."""
    if not isinstance(model, DistributedDataParallel):
        return 0
    data = model._get_ddp_logging_data()  # a private API: DDP exposes its bucket sizes nowhere else
    sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""  # "827536, 1048576": bytes each
    return sum(int(size) for size in str(sizes).replace(",", " ").split())


def step_peak(step, device: torch.device) -> dict:
    """Run ``step()`` once and return the allocator's view of it on a GPU, or ``None`` on the CPU.

    ``before`` is what was allocated when the step began, ``peak`` the most allocated at any moment of it
    (``torch.cuda.max_memory_allocated``), ``increment`` their difference: gradients, activations, gathered
    parameters and the optimizer's temporaries.
    """
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return {"before": before, "peak": peak, "increment": peak - before, "source": "torch.cuda.max_memory_allocated"}


def profiled_step(step) -> profile:
    """Run ``step()`` once under ``torch.profiler`` with memory events and input shapes, and return the profile."""
    # Kineto logs two lines per profile to stderr ("USDT ... profiler_start"), and on a CUDA build without a GPU
    # an error about the device count: level 6 keeps the notebook's output readable; set it to see them.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof:
        step()
    return prof


def cpu_peak_increment(prof: profile) -> int:
    """The most CPU memory the profiled step had allocated at any moment beyond what it started with.

    Every allocation and free by PyTorch's CPU allocator while profiling is one ``[memory]`` event with its
    bytes (negative for a free); their running sum in time order peaks at the step's peak. Frees of tensors made
    before the profile began are not events (the profiler does not know their size), so release those first
    (``zero_grad(set_to_none=True)``) or the increment is overstated by them. Memory that gloo or the C library
    allocates outside PyTorch's allocator is not counted.
    """
    cpu = torch.autograd.DeviceType.CPU
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() == cpu]
    running = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        running += event.nbytes()
        peak = max(peak, running)
    return peak
