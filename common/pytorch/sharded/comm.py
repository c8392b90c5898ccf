"""Measured communication per step: which collectives a strategy calls, on how many bytes, over how many processes.

:class:`CollectiveLog` records every collective as it is dispatched: DDP's bucket all-reduces (called by its C++
reducer, which still goes through the dispatcher), FSDP2's all-gathers and reduce-scatters (``c10d`` ops) and
DTensor's all-reduces (functional collectives). It works the same over gloo and NCCL. PyTorch's own
``CommDebugMode`` sees the same calls but keeps only their counts, not their sizes.

What the backend then does is another matter: gloo has no reduce-scatter of its own, and runs FSDP2's
``_reduce_scatter_base_`` as an all-reduce of the whole buffer (measured, torch 2.14: the profiler shows
``gloo:all_reduce`` of the full size under each reduce-scatter). :func:`backend_calls` lists those.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode

from common.pytorch.sharded.formula import ring_factor

# Dispatcher op name -> (collective kind, index of the argument holding what this process contributes).
_OPS = {
    "c10d::allreduce_": ("all_reduce", 0),
    "c10d::allreduce_coalesced_": ("all_reduce", 0),
    "c10d::_allgather_base_": ("all_gather", 1),
    "c10d::allgather_": ("all_gather", 1),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", 1),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", 1),
    "c10d::reduce_scatter_": ("reduce_scatter", 1),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "c10d::broadcast_": ("broadcast", 0),
    "_c10d_functional::all_reduce": ("all_reduce", 0),
    "_c10d_functional::all_reduce_": ("all_reduce", 0),
    "_c10d_functional::all_reduce_coalesced": ("all_reduce", 0),
    "_c10d_functional::all_gather_into_tensor": ("all_gather", 0),
    "_c10d_functional::all_gather_into_tensor_coalesced": ("all_gather", 0),
    "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", 0),
    "_c10d_functional::reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
    "_c10d_functional::broadcast": ("broadcast", 0),
    "_c10d_functional::all_to_all_single": ("all_to_all", 0),
}


@dataclass(frozen=True)
class Collective:
    """One collective call: its kind, the bytes of its whole buffer, and the processes in its group.

    ``buffer_bytes`` is what the textbook calls the message: the all-reduced tensor, an all-gather's output, a
    reduce-scatter's input.
    """

    kind: str
    buffer_bytes: int
    group_size: int

    @property
    def sent_bytes(self) -> float:
        """Bytes one process sends for it with the ring algorithm (:func:`~.formula.ring_factor`)."""
        return ring_factor(self.kind, self.group_size) * self.buffer_bytes


class CollectiveLog(TorchDispatchMode):
    """``with CollectiveLog() as log: step()``; then ``log.calls`` lists the :class:`Collective` s of the step."""

    def __init__(self):
        super().__init__()
        self.calls: list[Collective] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name  # "c10d::allreduce_": the op, whatever its overload
        if name in _OPS:
            kind, index = _OPS[name]
            group = _group_size(args)
            contributed = _bytes(args[index])
            buffer = contributed * group if kind == "all_gather" else contributed
            self.calls.append(Collective(kind, buffer, group))
        return func(*args, **(kwargs or {}))


def _bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_bytes(v) for v in value)
    return 0


def _group_size(args) -> int:
    """The size of the process group in a collective's arguments: a boxed ProcessGroup (c10d ops) or its name."""
    for arg in args:
        if isinstance(arg, torch.ScriptObject):
            return dist.ProcessGroup.unbox(arg).size()
    names = [arg for arg in args if isinstance(arg, str)]
    if names:
        return _resolve_process_group(names[-1]).size()  # functional collectives end with the group's name
    return dist.get_world_size()


def summarize(calls: list[Collective]) -> dict:
    """Per kind: how many calls, their buffer bytes, the bytes one process sends; and the totals."""
    kinds: dict[str, dict] = {}
    for call in calls:
        entry = kinds.setdefault(call.kind, {"calls": 0, "buffer_bytes": 0, "sent_bytes": 0.0})
        entry["calls"] += 1
        entry["buffer_bytes"] += call.buffer_bytes
        entry["sent_bytes"] += call.sent_bytes
    return {
        "by_kind": kinds,
        "calls": len(calls),
        "buffer_bytes": sum(c.buffer_bytes for c in calls),
        "sent_bytes": sum(c.sent_bytes for c in calls),
    }


def backend_calls(prof) -> dict[str, dict[str, int]]:
    """What the backend ran in a profiled step (``gloo:all_reduce``, ``nccl:all_gather``, ...): calls, elements.

    ``prof`` comes from :func:`~.memory.profiled_step` (which records input shapes). The elements are those of
    each call's first input as the profiler records it.
    """
    counts: Counter = Counter()
    elements: Counter = Counter()
    for event in prof.events():
        if event.name.startswith(("gloo:", "nccl:")):
            counts[event.name] += 1
            shapes = event.input_shapes or [[]]
            first = shapes[0] if shapes and isinstance(shapes[0], list | tuple) else []
            size = 1
            for dim in first:
                size *= dim
            elements[event.name] += size if first else 0
    return {name: {"calls": counts[name], "elements": elements[name]} for name in sorted(counts)}
