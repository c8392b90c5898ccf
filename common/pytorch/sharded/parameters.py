"""The notebook's own parameters, checked before any training time is spent, and the MLP sizes it measures."""

from __future__ import annotations

from common.errors import InputError
from common.pytorch.sharded.model import MLPShape, check_tensor_parallel
from common.run import params

TRAINED = ("ddp", "zero2", "zero3")  # the ways DenseNet-121 trains (tensor parallelism needs a plan per layer)
IN_FEATURES = 64  # the MLP's input: a feature vector, not an image
MLP_BATCH = 16  # the MLP's global batch in the benchmark: activations stay small beside the model state
CHECK_MLP = MLPShape(in_features=24, width=32, depth=4)  # small: the check compares losses, not memory
DEFAULT_WIDTH = {"cpu": 1024, "gpu": 8192}
CPU_MEMORY_GIB = 16  # on a CPU, "what fits where" answers for a 16 GiB GPU


def check_parameters(hardware, **given) -> tuple[MLPShape, float]:
    """Refuse what this notebook cannot do, naming the fix; return the benchmark's MLP and the memory per device that
    "what fits where" answers for."""
    if given["PRECISION"] != "fp32":
        raise InputError(
            f"PRECISION={given['PRECISION']!r}: this notebook counts bytes in fp32 (4 + 4 + 8 per parameter with "
            "Adam); set PRECISION = 'fp32' (PyTorch_Speedups teaches mixed precision)."
        )
    params.check_choice("STRATEGY", given["STRATEGY"], TRAINED)
    width = given["MLP_WIDTH"] or DEFAULT_WIDTH[hardware.kind]
    shape = MLPShape(IN_FEATURES, width, given["MLP_DEPTH"])  # refuses a width or depth that is not a positive count
    check_tensor_parallel(shape, hardware.count)
    if MLP_BATCH % hardware.count:
        raise InputError(
            f"The MLP's batch of {MLP_BATCH} does not split over {hardware.count} devices: use 1, 2, 4, 8 "
            "or 16 DEVICES."
        )
    memory = given["MEMORY_GIB"] or hardware.memory_gib or CPU_MEMORY_GIB
    if not memory > 0:
        raise InputError(f"MEMORY_GIB={given['MEMORY_GIB']!r}: give the memory per device in GiB, or None.")
    return shape, float(memory)
