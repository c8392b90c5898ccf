"""Checks of the notebook's parameters before anything trains: a bad value is refused with its fix."""

from __future__ import annotations

from common.errors import InputError
from common.pytorch import utils as tu
from common.pytorch.model_parallel.split import STAGES


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
    if precision == "mixed" and hardware.kind == "gpu" and not tu.native_bf16():
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
