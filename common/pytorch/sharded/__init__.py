"""One wide MLP trained four ways over N processes: replicated (DDP), ZeRO-2 and ZeRO-3 (FSDP2), tensor parallel.

Used by ``PyTorch_Sharded`` and its launched scripts, as ``sharded.<name>`` after
``from common.pytorch import sharded``; every name below comes from one submodule, one job each:

- ``model``: the MLP whose width sets its memory, its parameter count, its tensor-parallel plan;
- ``wrap``: the device meshes and the four wrappings, each the lines of PyTorch's own tutorial;
- ``training``: the shared data and step, the losses of a strategy, the check against DDP's;
- ``memory``: bytes of model state a process holds, and its peak during a step (allocator or profiler);
- ``comm``: the collectives a step calls, with their sizes and group sizes, and what the backend ran;
- ``formula``: the ZeRO paper's bytes per device, FSDP2's padding, the textbook's bytes sent per step;
- ``measure``: all of the above for one strategy in one process;
- ``parameters``: the notebook's own parameters, checked, and the MLP sizes it measures;
- ``report``: the notebook's tables and its "when to choose which" (imported as its own module).
"""

from common.pytorch.sharded.comm import Collective, CollectiveLog, backend_calls, summarize
from common.pytorch.sharded.formula import (
    PRECISIONS,
    fsdp2_bytes,
    largest_width,
    padded_shard_numel,
    padding_bytes,
    paper_bytes,
    ring_factor,
    textbook_comm_bytes,
    tp_bytes,
    tp_comm_bytes,
    tp_local_shapes,
)
from common.pytorch.sharded.measure import measure
from common.pytorch.sharded.memory import cpu_peak_increment, held_bytes, local, profiled_step, step_peak
from common.pytorch.sharded.model import MLPShape, check_tensor_parallel, parameter_count, plan_table, tp_plan
from common.pytorch.sharded.parameters import CHECK_MLP, MLP_BATCH, check_parameters
from common.pytorch.sharded.training import (
    ADAM_LEARNING_RATE,
    CHECK_LEARNING_RATE,
    CHECK_OPTIMIZER,
    LOSS_TOLERANCE,
    build,
    global_batch_for,
    global_loss,
    local_rows,
    loss_difference,
    losses,
    make_optimizer,
    train_step,
)
from common.pytorch.sharded.wrap import STRATEGIES, make_mesh, replicate, shard, tensor_parallel, wrap

__all__ = [
    "ADAM_LEARNING_RATE",
    "CHECK_MLP",
    "MLP_BATCH",
    "CHECK_LEARNING_RATE",
    "CHECK_OPTIMIZER",
    "LOSS_TOLERANCE",
    "PRECISIONS",
    "STRATEGIES",
    "Collective",
    "CollectiveLog",
    "MLPShape",
    "backend_calls",
    "build",
    "check_parameters",
    "check_tensor_parallel",
    "cpu_peak_increment",
    "fsdp2_bytes",
    "global_batch_for",
    "global_loss",
    "held_bytes",
    "largest_width",
    "local",
    "local_rows",
    "loss_difference",
    "losses",
    "make_mesh",
    "make_optimizer",
    "measure",
    "padded_shard_numel",
    "padding_bytes",
    "paper_bytes",
    "parameter_count",
    "plan_table",
    "profiled_step",
    "replicate",
    "ring_factor",
    "shard",
    "step_peak",
    "summarize",
    "tensor_parallel",
    "textbook_comm_bytes",
    "tp_bytes",
    "tp_comm_bytes",
    "tp_local_shapes",
    "tp_plan",
    "train_step",
    "wrap",
]
