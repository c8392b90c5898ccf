"""The textbook numbers: bytes of model state per device (ZeRO paper), FSDP2's padding, bytes sent per step.

Source: Rajbhandari, Rasley, Ruwase, He, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
SC 2020 (arXiv:1910.02054), section 3.1 and Figure 1 for memory, section 7 for communication. Ψ is the number of
parameters and N the number of data-parallel devices.

Memory (bytes per device): the paper trains in mixed precision with Adam: fp16 parameters (2Ψ) and gradients
(2Ψ), and K = 12 bytes of fp32 optimizer state per parameter (master weights, momentum, variance). In plain fp32
with Adam the parameters are their own master copy: 4Ψ + 4Ψ + 8Ψ. Either way a replica costs 16Ψ:

=========  ==================  ==========================  ==========
 strategy   parameters          gradients                   optimizer
=========  ==================  ==========================  ==========
 ddp        4Ψ (2Ψ)             4Ψ (2Ψ)                     8Ψ (12Ψ)
 zero1      4Ψ (2Ψ)             4Ψ (2Ψ)                     8Ψ/N (12Ψ/N)
 zero2      4Ψ (2Ψ)             4Ψ/N (2Ψ/N)                 8Ψ/N (12Ψ/N)
 zero3      4Ψ/N (2Ψ/N)         4Ψ/N (2Ψ/N)                 8Ψ/N (12Ψ/N)
=========  ==================  ==========================  ==========

(fp32, in brackets mixed precision): DDP 16Ψ, ZeRO-2 4Ψ + 12Ψ/N (2Ψ + 14Ψ/N), ZeRO-3 16Ψ/N.

What FSDP2 really holds is not the ZeRO-2 row (measured, torch 2.14): after backward FSDP2 reshards every layer
whatever ``reshard_after_forward`` says, so between steps ``zero2`` and ``zero3`` both hold the ZeRO-3 row,
16Ψ/N. ``reshard_after_forward=False`` changes only the window from each layer's forward to its backward: there
``zero2`` holds that layer's whole parameters as well (all of them, 4Ψ, when backward starts), ``zero3`` only the
one or two layers being computed. See :func:`fsdp2_bytes`.
"""

from __future__ import annotations

import math

from common.errors import InputError

# Bytes per parameter of (parameters, gradients, optimizer state) with Adam, per the ZeRO paper.
PRECISIONS = {"fp32": (4, 4, 8), "mixed": (2, 2, 12)}


def _per_parameter(precision: str) -> tuple[int, int, int]:
    if precision not in PRECISIONS:
        raise InputError(f"precision={precision!r}: choose one of {', '.join(PRECISIONS)}.")
    return PRECISIONS[precision]


def paper_bytes(strategy: str, parameters: int, devices: int, precision: str = "fp32") -> dict[str, float]:
    """The ZeRO paper's model-state bytes per device for ``ddp``, ``zero1``, ``zero2``, ``zero3`` (table above).

    Returns ``parameters``, ``gradients``, ``optimizer_state`` and ``total``. Activations, buffers and
    temporaries are not model state: the paper counts them apart, and so does :func:`~.memory.held_bytes`.
    """
    p, g, k = _per_parameter(precision)
    sharded = {
        "ddp": (False, False, False),
        "zero1": (False, False, True),
        "zero2": (False, True, True),
        "zero3": (True, True, True),
    }
    if strategy not in sharded:
        raise InputError(f"strategy={strategy!r}: the ZeRO paper's stages are {', '.join(sharded)}.")
    found = {
        name: per * parameters / (devices if split else 1)
        for name, per, split in zip(("parameters", "gradients", "optimizer_state"), (p, g, k), sharded[strategy])
    }
    found["total"] = sum(found.values())
    return found


def fsdp2_bytes(
    strategy: str, parameter_shapes, devices: int, precision: str = "fp32", rank: int | None = None
) -> dict[str, float]:
    """What DDP (``ddp``) or FSDP2 (``zero2``, ``zero3``) holds per process between steps, padding included.

    FSDP2 splits every parameter along dim 0 into N equal chunks of ``ceil(rows / N)`` rows, padding the last
    rank's chunk with zeros. The padded chunk is the parameter's storage on every rank, and the sharded gradient
    lands in one of the same size, so parameters and gradients cost ``padded_numel`` each, on every rank. The
    optimizer state is created from the unpadded view (``to_local()``), so it is exact per rank: pass ``rank`` for
    its value there, or leave it out for the mean over ranks (8Ψ/N).

    ``zero2`` and ``zero3`` give the same numbers: that is what FSDP2 holds at rest (see the module docstring).
    The extra that ``zero2`` holds from forward to backward is ``unsharded_window``: every layer's gathered
    parameters at the start of backward (4Ψ in fp32, 2Ψ for a bf16 ``MixedPrecisionPolicy``). For ``zero3`` it is
    the largest group or two, so it is left at 0 here and measured by :func:`~.memory.step_peak`.
    In mixed precision FSDP2 keeps fp32 shards (its master weights) and fp32 sharded gradients, so the rest
    total is still 16Ψ/N; the row below splits it as the paper does.
    """
    shapes = [tuple(s) for s in parameter_shapes]
    parameters = sum(math.prod(s) for s in shapes)
    p, g, k = _per_parameter(precision)
    if strategy == "ddp":
        return {**paper_bytes("ddp", parameters, devices, precision), "unsharded_window": 0}
    if strategy not in ("zero2", "zero3"):
        raise InputError(f"strategy={strategy!r}: FSDP2's strategies here are zero2 and zero3 (and ddp for contrast).")
    padded = padded_shard_numel(shapes, devices)
    local = parameters / devices if rank is None else sum(_shard_rows(s[0], devices, rank) * _row(s) for s in shapes)
    found = {"parameters": p * padded, "gradients": g * padded, "optimizer_state": k * local}
    found["total"] = sum(found.values())
    found["unsharded_window"] = p * parameters if strategy == "zero2" else 0
    return found


def padded_shard_numel(parameter_shapes, devices: int) -> int:
    """Elements one process stores for FSDP2's dim-0 shards of these parameters: ``ceil(rows / N) x row`` each."""
    return sum(math.ceil(s[0] / devices) * _row(s) for s in parameter_shapes)


def padding_bytes(parameter_shapes, devices: int, bytes_per_element: int = 4) -> float:
    """How much more than Ψ/N one process stores per sharded tensor kind: FSDP2's padding, exactly.

    At most ``(N - 1) / N`` rows of each parameter (less than one row of each), zero when every parameter's
    first dimension divides by N. Applies to parameters and to gradients (each), not to optimizer state.
    """
    shapes = [tuple(s) for s in parameter_shapes]
    parameters = sum(math.prod(s) for s in shapes)
    return bytes_per_element * (padded_shard_numel(shapes, devices) - parameters / devices)


def _row(shape) -> int:
    return math.prod(shape[1:])


def _shard_rows(rows: int, devices: int, rank: int) -> int:
    """Rows of rank ``rank``'s shard: ``torch.chunk``'s split, as FSDP2 and DTensor use (the last ones may be short)."""
    size = math.ceil(rows / devices)
    return max(0, min(size, rows - rank * size))


def tp_local_shapes(linear_sizes, tensor_parallel: int) -> list[tuple[int, ...]]:
    """Every parameter's shape on one TP rank under :func:`~.model.tp_plan` (before FSDP on the data axis).

    Column-wise layers split weight rows and bias, row-wise layers split weight columns and replicate the bias.
    """
    shapes = []
    for i, (out, inp) in enumerate(linear_sizes):
        if i % 2 == 0:
            shapes += [(out // tensor_parallel, inp), (out // tensor_parallel,)]
        else:
            shapes += [(out, inp // tensor_parallel), (out,)]
    return shapes


def tp_bytes(linear_sizes, tensor_parallel: int, data_parallel: int = 1, precision: str = "fp32") -> dict[str, float]:
    """Model-state bytes per process of ``tp``: the TP shard of each parameter, then FSDP's dp shard of that.

    FSDP pads parameters and gradients on the data axis (as in :func:`fsdp2_bytes`); the optimizer state is the
    mean over the data-parallel ranks. With one process on the data axis nothing is padded.
    """
    p, g, k = _per_parameter(precision)
    shapes = tp_local_shapes(linear_sizes, tensor_parallel)
    padded = padded_shard_numel(shapes, data_parallel)
    local = sum(math.prod(s) for s in shapes) / data_parallel
    found = {"parameters": p * padded, "gradients": g * padded, "optimizer_state": k * local}
    found["total"] = sum(found.values())
    return found


def ring_factor(kind: str, group_size: int) -> float:
    """Bytes one process sends per byte of the full buffer, for the ring algorithms the paper assumes.

    All-reduce (reduce-scatter, then all-gather): ``2(N-1)/N``; all-gather and reduce-scatter alone: ``(N-1)/N``.
    """
    n = group_size
    factors = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n}
    return factors.get(kind, (n - 1) / n)


def textbook_comm_bytes(strategy: str, parameters: int, devices: int, bytes_per_element: int = 4) -> float:
    """Bytes one process sends per step (ZeRO paper, section 7), with ring collectives over N devices.

    DDP all-reduces the gradients: ``2(N-1)/N Ψ``. ZeRO-2 reduce-scatters gradients and all-gathers the updated
    parameters: the same ``2(N-1)/N Ψ``. ZeRO-3 gathers the parameters twice (forward and backward) and
    reduce-scatters once: ``3(N-1)/N Ψ``, 1.5x DDP. Times ``bytes_per_element`` (4 in fp32).
    """
    rounds = {"ddp": 2, "zero1": 2, "zero2": 2, "zero3": 3}
    if strategy not in rounds:
        raise InputError(f"strategy={strategy!r}: textbook volumes are for {', '.join(rounds)}; tp: tp_comm_bytes.")
    return rounds[strategy] * (devices - 1) / devices * parameters * bytes_per_element


def tp_comm_bytes(linear_sizes, batch: int, tensor_parallel: int, bytes_per_element: int = 4) -> float:
    """Bytes one process sends per step under :func:`~.model.tp_plan`: activations, not parameters.

    Forward all-reduces each row-wise layer's output (``batch x out``); backward all-reduces each column-wise
    layer's input gradient (``batch x in``), except the first layer's, whose input is the data. ``batch`` is the
    batch of one TP group (the global batch over the data-parallel size). FSDP's traffic on the data axis is not
    included (none with one process on it).
    """
    elements = 0
    for i, (out, inp) in enumerate(linear_sizes):
        if i % 2:
            elements += batch * out
        elif i > 0:
            elements += batch * inp
    return ring_factor("all_reduce", tensor_parallel) * elements * bytes_per_element


def largest_width(
    budget_bytes: float, strategy: str, devices: int, *, in_features: int, depth: int = 4, precision: str = "fp32"
) -> int:
    """The widest :class:`~.model.MLPShape` whose model state per device (ZeRO paper) fits in ``budget_bytes``.

    Activations and the allocator's slack come on top: leave room for them in the budget. ``zero2`` uses the
    paper's 4Ψ + 12Ψ/N, which is also about FSDP2's peak from forward to backward (see :func:`fsdp2_bytes`).
    """
    from common.pytorch.sharded.model import parameter_count

    def fits(width: int) -> bool:
        parameters = parameter_count(width, in_features, depth)
        return paper_bytes(strategy, parameters, devices, precision)["total"] <= budget_bytes

    if not fits(1):
        raise InputError(f"Not even width 1 fits in {budget_bytes:,.0f} bytes: give a larger budget.")
    low, high = 1, 2
    while fits(high):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low
