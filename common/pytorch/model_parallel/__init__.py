"""One DenseNet-121 cut into two stages: naive model parallelism, a GPipe pipeline, and how to measure them.

Used by ``PyTorch_ModelParallel`` and its training scripts, as ``parallel.<name>`` after
``from common.pytorch import model_parallel as parallel``; every name below comes from one submodule, one job each:

- ``split``: the cut into two stages, the whole model again from their states, naive model parallelism;
- ``pipeline``: the stage wrapper and the loss of the notebook's GPipe schedule, and the batches a stage is fed;
- ``processes``: worlds of one: the first stage's reader, the sweep's trainers, the assembled model's evaluation;
- ``equivalence``: the check that the notebook's pipeline computes what one device computes;
- ``timing``: seconds per step, each stage's own work, the bubble;
- ``report``: the benchmark and bubble tables, the record fields, the advice text;
- ``checks``: the checks of the notebook's parameters.
"""

from common.pytorch.model_parallel.checks import (
    check_devices,
    check_micro_batches,
    check_precision,
    sweep_learning_rates,
)
from common.pytorch.model_parallel.equivalence import (
    EQUIVALENCE_IMAGE_SIZE,
    EQUIVALENCE_LEARNING_RATE,
    EQUIVALENCE_STEPS,
    EQUIVALENCE_TOLERANCE,
    accumulated_step,
    check_equivalence,
    exact_arithmetic,
    merge_equivalence,
)
from common.pytorch.model_parallel.pipeline import Autocast, bce_loss, labels_loader, random_batch
from common.pytorch.model_parallel.processes import evaluate_assembled, independent_process, single_process
from common.pytorch.model_parallel.report import (
    advice,
    benchmark_table,
    bubble_table,
    device_names,
    extra_fields,
    not_measured,
    pipeline_step_seconds,
)
from common.pytorch.model_parallel.split import (
    SPLIT_AT,
    STAGES,
    NaiveModelParallel,
    Stage,
    build_stages,
    merge_states,
    parameters_per_stage,
    split_densenet,
)
from common.pytorch.model_parallel.timing import (
    bubble_fraction,
    merge_benchmark,
    paired_times,
    seconds_per_step,
    stage_alone_step,
    stage_input,
    stage_seconds,
    textbook_bubble,
    training_step,
)

__all__ = [
    "EQUIVALENCE_IMAGE_SIZE",
    "EQUIVALENCE_LEARNING_RATE",
    "EQUIVALENCE_STEPS",
    "EQUIVALENCE_TOLERANCE",
    "SPLIT_AT",
    "STAGES",
    "Autocast",
    "NaiveModelParallel",
    "Stage",
    "accumulated_step",
    "advice",
    "bce_loss",
    "benchmark_table",
    "bubble_fraction",
    "bubble_table",
    "build_stages",
    "check_devices",
    "check_equivalence",
    "check_micro_batches",
    "check_precision",
    "device_names",
    "evaluate_assembled",
    "exact_arithmetic",
    "extra_fields",
    "independent_process",
    "labels_loader",
    "merge_benchmark",
    "merge_equivalence",
    "merge_states",
    "not_measured",
    "paired_times",
    "parameters_per_stage",
    "pipeline_step_seconds",
    "random_batch",
    "seconds_per_step",
    "single_process",
    "split_densenet",
    "stage_alone_step",
    "stage_input",
    "stage_seconds",
    "sweep_learning_rates",
    "textbook_bubble",
    "training_step",
]
