"""What held a training run back, read from the run's own records: one verdict, the numbers behind it, one thing to try.

A throughput figure alone does not say what to change. The records of a run already hold the answer: the phases
(:mod:`common.measure.phases`) say how much of the run the steps filled, the seconds the loop waited for batches say
whether the input kept up, the in-RAM benchmark of the same run is the speed of the same step with no input at all, the
utilization and peak memory of each device (:mod:`common.measure.monitor`) show whether the devices shared the work, and
the one-device run of the same notebook shows what the extra devices added. :func:`diagnose` applies the rules below in
this order and gives the first that holds; a rule whose figures are missing is skipped and says so:

1. ``start-up or evaluation dominated``: more of the run went outside its steady steps than into them.
2. ``input-bound``: the loop waited for batches, or trained well below the in-RAM speed of the same step.
3. ``devices unevenly used``: the devices' utilization or peak memory differ by much.
4. ``communication-bound``: the devices together reached well under devices x the one-device speed.
5. ``the steps keep the devices busy``: none of the above.

The order goes from the cause that hides the others to the most specific one: a run that is mostly start-up says
little about its steps, an input that starves the devices also makes them uneven and scale badly, and an uneven
placement (DataParallel's device 0) also lowers scaling.

:func:`table` gives one diagnosis per notebook run for the report.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass, field

import pandas as pd

from common.measure import phases as run_phases
from common.measure import results

START_UP = "start-up or evaluation dominated"
INPUT = "input-bound"
UNEVEN = "devices unevenly used"
COMMUNICATION = "communication-bound"
BUSY = "the steps keep the devices busy"
VERDICTS = (START_UP, INPUT, UNEVEN, COMMUNICATION, BUSY)  # in the order the rules are tried

# Nearly a third of the training seconds spent waiting: removing the wait would speed training up by 40% or more,
# more than most changes to the step itself give.
WAIT_SHARE = 0.3
# Training below 70% of the in-RAM speed of the same step: the only difference between the two is the input, so
# the input costs the run at least 30%; it counts as the cause only when the loop measurably waited (or the
# framework does not let the loop see its wait, as Keras' model.fit).
RAM_RATIO = 0.7
WAIT_NOTICED = 0.1  # a tenth of the training seconds: more than timing noise, enough to blame the input for a gap
# Replicas of the same step on the same kind of device stay within a few points of each other; 20 points means one
# device idles a fifth of the time the other works.
UTILIZATION_SPREAD = 20.0
# DDP replicas hold the same weights, gradients and optimizer state (ratio near 1.0); DataParallel keeps the
# optimizer state and the gathered outputs on device 0 alone, which shows as 1.3x and above.
MEMORY_IMBALANCE = 1.3
# Below 0.6, two devices give less than 1.2x one: a large part of each step goes to exchanging gradients.
SCALING_EFFICIENCY = 0.6
# Mean utilization below which "busy" steps still leave the device idle between kernels (launch and host overhead).
LOW_UTILIZATION = 60.0

# The names of the figures in Diagnosis.numbers, as a reader sees them.
SPAN = "run span"
OUTSIDE = "outside the steps, share of the run"
STEPS_SHARE = "steps, share of the run"
LARGEST = "largest phase outside the steps"
LARGEST_SECONDS = "time in the largest phase"
WAIT = "waiting for batches, share of training time"
TRAIN_RATE = "training images/s"
RAM_RATE = "in-RAM images/s"
RATE_RATIO = "training over in-RAM images/s"
UTILIZATION = "mean device utilization"
SPREAD = "utilization spread between devices"
MEMORY = "device 0 peak memory over the others' mean"
SINGLE_RATE = "one-device images/s"
EFFICIENCY = "scaling efficiency"


@dataclass(frozen=True)
class Diagnosis:
    """``verdict`` (one of ``VERDICTS``); ``numbers``: every figure found, None where the records lack it;
    ``behind``: the names of the figures the verdict rests on; ``first_try``: one sentence of advice;
    ``skipped``: the rules that could not be judged, and why."""

    verdict: str
    numbers: dict[str, float | str | None]
    behind: tuple[str, ...]
    first_try: str
    skipped: tuple[str, ...] = field(default=())

    @property
    def key_number(self) -> str:
        """The first figure behind the verdict, rounded for reading."""
        name = self.behind[0]
        return f"{name}: {_readable(name, self.numbers[name])}"

    def describe(self) -> str:
        behind = "; ".join(f"{name}: {_readable(name, self.numbers[name])}" for name in self.behind)
        rest = [name for name, value in self.numbers.items() if name not in self.behind and value is not None]
        lines = [f"Diagnosis: {self.verdict} ({behind})."]
        if rest:
            lines.append(
                "Also measured: " + "; ".join(f"{name}: {_readable(name, self.numbers[name])}" for name in rest) + "."
            )
        missing = [name for name, value in self.numbers.items() if value is None]
        if missing:
            lines.append("Not available: " + "; ".join(missing) + ".")
        lines += [f"Not judged: {reason}." for reason in self.skipped]
        lines.append(f"First try: {self.first_try}")
        return "\n".join(lines)

    __str__ = describe


def diagnose(
    training: dict, benchmark: dict | None = None, single_device_images_per_second: float | None = None
) -> Diagnosis:
    """Diagnose a training record (``data`` real or generated), with the in-RAM benchmark record of the same run and
    the training images/s of the same notebook on one device (same device kind and precision) where known."""
    numbers = _figures(training, benchmark, single_device_images_per_second)
    skipped: list[str] = []
    kind, devices = training.get("device_kind"), training.get("devices") or 1

    def verdict(name: str, behind: tuple[str, ...], first_try: str) -> Diagnosis:
        return Diagnosis(name, numbers, behind, first_try, tuple(skipped))

    # 1. Start-up or evaluation
    if numbers[OUTSIDE] is None:
        skipped.append(f"{START_UP}: the record holds no phases")
    elif numbers[OUTSIDE] > numbers[STEPS_SHARE]:  # the steps no longer decide how long the run takes
        phase, seconds = numbers[LARGEST], numbers[LARGEST_SECONDS]
        advice = _phase_advice(phase, training)
        return verdict(
            START_UP, (OUTSIDE, LARGEST, LARGEST_SECONDS), f"The largest is {phase} ({seconds:,.0f} s): {advice}"
        )

    # 2. Input
    wait, ratio = numbers[WAIT], numbers[RATE_RATIO]
    if wait is None and ratio is None:
        skipped.append(f"{INPUT}: neither the wait for batches nor an in-RAM benchmark is in the records")
    elif wait is not None and wait > WAIT_SHARE:
        return verdict(INPUT, (WAIT, RATE_RATIO), _input_advice(training))
    elif ratio is not None and ratio < RAM_RATIO and (wait is None or wait > WAIT_NOTICED):
        return verdict(INPUT, (RATE_RATIO, WAIT), _input_advice(training))

    # 3. Uneven devices
    if devices < 2:
        skipped.append(f"{UNEVEN}: one device")
    elif kind == "cpu":
        skipped.append(f"{UNEVEN}: simulated CPU devices share the cores and are measured as one")
    elif numbers[SPREAD] is None and numbers[MEMORY] is None:
        skipped.append(f"{UNEVEN}: the records hold fewer than two devices' utilization and memory")
    elif (numbers[SPREAD] or 0.0) > UTILIZATION_SPREAD:
        return verdict(UNEVEN, (SPREAD, MEMORY, UTILIZATION), _uneven_advice(training))
    elif (numbers[MEMORY] or 0.0) > MEMORY_IMBALANCE:
        return verdict(UNEVEN, (MEMORY, SPREAD), _uneven_advice(training))

    # 4. Communication
    if devices < 2:
        skipped.append(f"{COMMUNICATION}: one device")
    elif kind == "cpu":  # N simulated devices split the cores one device had to itself: about 1/N is all they can give
        skipped.append(f"{COMMUNICATION}: simulated CPU devices share the cores of one device")
    elif numbers[EFFICIENCY] is None:
        skipped.append(f"{COMMUNICATION}: no one-device run of the same notebook")
    elif numbers[EFFICIENCY] < SCALING_EFFICIENCY:
        advice = COMMUNICATION_ADVICE + FRAMEWORK_EXCHANGE.get(_framework(training), ".")
        return verdict(COMMUNICATION, (EFFICIENCY, WAIT), advice)

    # 5. Busy
    behind = tuple(name for name in (UTILIZATION, STEPS_SHARE, WAIT, EFFICIENCY) if numbers[name] is not None)
    return verdict(BUSY, behind or (TRAIN_RATE,), _busy_advice(training, numbers[UTILIZATION]))


def _figures(training: dict, benchmark: dict | None, single: float | None) -> dict[str, float | str | None]:
    """Every figure the rules read, None where the records lack it."""
    devices = training.get("devices") or 1
    numbers = _outside_steps(training.get("phases"))
    numbers[WAIT] = _wait_share(training.get("data_wait_seconds"), training.get("epoch_seconds") or [])
    numbers[TRAIN_RATE] = training.get("images_per_second")
    numbers[RAM_RATE] = benchmark.get("images_per_second") if benchmark else None
    numbers[RATE_RATIO] = _ratio(numbers[TRAIN_RATE], numbers[RAM_RATE])
    utilization, peaks = _used_devices(training, devices)
    numbers[UTILIZATION] = sum(utilization) / len(utilization) if utilization else None
    numbers[SPREAD] = max(utilization) - min(utilization) if devices > 1 and len(utilization) > 1 else None
    numbers[MEMORY] = _memory_imbalance(peaks) if devices > 1 else None
    numbers[SINGLE_RATE] = single
    numbers[EFFICIENCY] = _ratio(numbers[TRAIN_RATE], (single or 0.0) * devices) if devices > 1 else None
    return numbers


PHASE_ADVICE = {
    "start-up": "train more epochs per run (EPOCHS): imports and process start are paid once, however long the run.",
    "launch": "train more epochs per run (EPOCHS): starting the training processes is paid once per run.",
    "teardown": "train more epochs per run (EPOCHS): the processes' exit is paid once per run.",
    "data check": "prepare the data set once (`make prepare`, PREPARED=True): later runs check its manifest instead of "
    "every image.",
    "model build": "train more epochs per run (EPOCHS): building and placing the model is paid once per run.",
    "check": "train more epochs per run (EPOCHS): the check of the parallel arithmetic is paid once per run.",
    "validate": "validate less often or with a larger batch: the validation split is scored after every epoch.",
    "checkpoint": "checkpoint less often or to a faster disk (CHECKPOINT_DIR=None writes none).",
    "precise BN": "re-estimate BatchNorm on fewer batches (common.run.params.BATCH_NORM_BATCHES) or train more epochs.",
    "test": "train more epochs per run, or score the test split with a larger batch: it is scored once per run.",
    "benchmark warm-up": "train more epochs per run: the in-RAM benchmark's warm-up is paid once per run.",
}


def _framework(training: dict) -> str | None:
    """What the tables below know a run's framework by: Keras on its JAX backend ("keras-jax") compiles its steps as
    JAX does, with none of TensorFlow's strategies to choose from."""
    if training.get("framework") == "keras" and training.get("backend") == "jax":
        return "keras-jax"
    return training.get("framework")


COMMUNICATION_ADVICE = "A larger BATCH_SIZE_PER_DEVICE, so each exchange of the gradients serves more images"
FRAMEWORK_EXCHANGE = {
    "pytorch": "; or gradient accumulation under DDP's no_sync(), one exchange per several batches (PyTorch_Speedups).",
    "mxnet": "; and KVSTORE='nccl', which sums the gradients on the GPUs.",
    "tensorflow": "; and MirroredStrategy's NCCL all-reduce rather than central_storage.",
    "keras": "; and MirroredStrategy's NCCL all-reduce rather than central_storage.",
    "chainer": "; and the pure_nccl communicator.",
    "jax": "; and PARALLELISM='data', whose one all-reduce moves less than fsdp's gathers and scatters.",
}


# What a framework's first steps do that later steps do not, on (GPU, CPU) devices.
FIRST_STEPS = {
    "pytorch": (
        "cuDNN's autotuning, and torch.compile's compiling where COMPILE=True,",
        "allocating the step's memory",
    ),
    "tensorflow": ("tracing the step into a graph and autotuning its kernels",) * 2,
    "keras": ("tracing the step into a graph and autotuning its kernels",) * 2,
    "mxnet": ("building the hybridized graph and its memory",) * 2,
    "chainer": ("compiling CuPy's kernels and allocating the step's memory", "allocating the step's memory"),
    "jax": ("compiling the step with XLA (a rerun of the same shapes loads it from the cache)",) * 2,
    "keras-jax": ("compiling the step with XLA (a rerun of the same shapes loads it from the cache)",) * 2,
}
# Notebooks that train in fp32 only (their parameter cells say why): no mixed precision to advise.
FP32_ONLY = ("DataParallel_From_Scratch", "PyTorch_Sharded")


def _phase_advice(phase: str, training: dict) -> str:
    if phase != "first steps":
        return PHASE_ADVICE.get(phase, PHASE_ADVICE["start-up"])
    gpu, cpu = FIRST_STEPS.get(_framework(training), ("the warm-up",) * 2)
    return f"train more epochs per run (EPOCHS): {gpu if training.get('device_kind') == 'gpu' else cpu} is paid once."


def _mixed_precision_helps(training: dict) -> bool:
    """Whether PRECISION='mixed' is worth advising: the notebook has it, the device runs it, the run did not use it."""
    if training.get("precision") == "mixed" or training.get("notebook") in FP32_ONLY:
        return False
    return not (training.get("framework") == "chainer" and training.get("device_kind") != "gpu")  # fp32 on CPUs


def _input_advice(training: dict) -> str:
    if training.get("prepared_size") is None:
        return (
            "Train from the prepared cache (PREPARED=True, `make prepare` once): reading pixels is far cheaper than "
            "decoding each PNG every epoch."
        )
    if training.get("device_kind") == "cpu":
        return (
            "The loader shares the cores with the simulated devices: a smaller IMAGE_SIZE or a machine with more "
            "cores; on GPUs each device gets up to 8 loader workers."
        )
    return (
        "More loader workers: common.run.devices.loader_workers gives each training process its cores less one, at "
        "most 8 per device, so give the run more CPU cores per device (PyTorch_Speedups measures LOADER_WORKERS)."
    )


def _uneven_advice(training: dict) -> str:
    variant = training.get("variant") or ""
    if variant == "dp-gather":
        return (
            "Compute the loss inside each replica (the dp-replica-loss way of PyTorch_MultiGPU-Exp-Loss), so device 0 "
            "no longer gathers every output."
        )
    if variant.startswith("dp"):
        return "Use DDP: DataParallel keeps the only optimizer state and the master weights on device 0."
    if training.get("strategy") == "central_storage":
        return "Use STRATEGY='mirrored': central_storage keeps every variable on one device."
    if variant.startswith("pipeline"):
        return (
            "Balance the pipeline's stages (move the split point) or raise PIPELINE_MICRO_BATCHES to shrink the bubble."
        )
    return "Check that every device gets an equal share of each batch and that nothing else runs on the busiest device."


# Where each framework's notebook makes the step itself faster: (the compiler it has, the notebook that measures it).
STEP_TOOLS = {
    "pytorch": ("torch.compile, CUDA graphs", "PyTorch_Speedups"),
    "tensorflow": ("XLA, jit_compile=True", "Keras_Speedups"),
    "keras": ("XLA, jit_compile=True", "Keras_Speedups"),
    "mxnet": ("hybridize(static_shape=True)", None),
    "chainer": (None, None),
    "jax": ("XLA: every step is compiled already", None),
    "keras-jax": ("XLA: every step is compiled already", None),
}


def _busy_advice(training: dict, utilization: float | None) -> str:
    compiler, toolbox = STEP_TOOLS.get(_framework(training), (None, None))
    measures = f" ({toolbox} measures each)" if toolbox else ""
    mixed = _mixed_precision_helps(training)
    if training.get("device_kind") != "gpu":
        bf16 = " or PRECISION='mixed' where this CPU has bfloat16 instructions" if mixed else ""
        return (
            f"The simulated devices keep the cores busy: more cores (or GPUs) would speed the steps up{bf16}{measures}."
        )
    if utilization is not None and utilization < LOW_UTILIZATION:
        fewer = f" ({compiler})" if compiler else ""
        return (
            "The devices still idle between kernels: a larger BATCH_SIZE_PER_DEVICE, or fewer host round-trips per "
            f"step{fewer}{measures}."
        )
    ways = ["PRECISION='mixed'"] * mixed + ["a larger batch"] + [f"a compiler ({compiler})"] * bool(compiler)
    listed = ", ".join(ways[:-1]) + " and " + ways[-1] if len(ways) > 1 else ways[0]
    return f"Make the step itself faster: {listed}{measures}."


def _outside_steps(rows: list[dict] | None) -> dict:
    """Span, share outside the steady steps and the largest phase there; None for each without phases."""
    found = dict.fromkeys((SPAN, STEPS_SHARE, OUTSIDE, LARGEST, LARGEST_SECONDS))
    if not rows:
        return found
    span = max(row["start"] + row["seconds"] for row in rows) - min(row["start"] for row in rows)
    if span <= 0:
        return found
    outside = run_phases.table(rows).drop(index=[*run_phases.STEPS, run_phases.BETWEEN], errors="ignore")["seconds"]
    found.update({SPAN: span, STEPS_SHARE: run_phases.steps_share(rows), OUTSIDE: float(outside.sum()) / span})
    if len(outside):
        found.update({LARGEST: str(outside.idxmax()), LARGEST_SECONDS: float(outside.max())})
    return found


def _wait_share(waits, epoch_seconds: list[float]) -> float | None:
    """Seconds waited over training seconds, leaving out the first epoch when there are more, as images/s does."""
    if waits is None:
        return None
    if isinstance(waits, int | float):  # one total for the whole run
        total = sum(epoch_seconds)
        return waits / total if total else None
    pairs = list(zip(waits, epoch_seconds))
    pairs = pairs[1:] or pairs
    measured = [(wait, seconds) for wait, seconds in pairs if wait is not None]  # Keras' model.fit: None
    total = sum(seconds for _, seconds in measured)
    return sum(wait for wait, _ in measured) / total if measured and total else None


def _ratio(numerator, denominator) -> float | None:
    if numerator is None or not denominator or _missing(numerator) or _missing(denominator):
        return None
    return numerator / denominator


def _missing(value) -> bool:
    return isinstance(value, float) and math.isnan(value)


def _used_devices(training: dict, devices: int) -> tuple[list[float], list[float]]:
    """Mean utilization and peak memory of the devices the run used, device 0 first.

    The monitor watches every GPU of the machine: with more watched than used, the busiest ``devices`` are taken as
    the used ones (an idle GPU that was not used reads about 0%; if a used one idled, an unused one stands for it at
    about the same figure, so the spread is still seen).
    """
    watched = training.get("device_utilization") or {}
    names = sorted(watched, key=_device_order)
    if len(names) > devices:
        busiest = sorted(names, key=lambda name: watched[name].get("utilization_mean_percent") or 0.0)[-devices:]
        names = [name for name in names if name in busiest]
    utilization = [watched[name]["utilization_mean_percent"] for name in names]
    # the framework's own count of each device's peak (allocated tensors) is sharper than NVML's used memory
    peaks = list((training.get("peak_memory_mib_per_device") or {}).values())
    if not peaks:
        peaks = [watched[name]["memory_peak_mib"] for name in names]
    return [u for u in utilization if u is not None], [p for p in peaks if p is not None]


def _device_order(name: str) -> tuple[str, int]:
    kind, _, index = name.rpartition(":")
    return (kind, int(index)) if index.isdigit() else (name, -1)


def _memory_imbalance(peaks: list[float]) -> float | None:
    from common.measure.metrics import memory_imbalance  # metrics imports scikit-learn: only when asked

    return memory_imbalance(dict(enumerate(peaks)))


def _readable(name: str, value) -> str:
    if value is None:
        return "not available"
    return value if isinstance(value, str) else READABLE.get(name, "{:,.1f}").format(value)


READABLE = {
    SPAN: "{:,.1f} s",
    OUTSIDE: "{:.0%}",
    STEPS_SHARE: "{:.0%}",
    LARGEST_SECONDS: "{:,.1f} s",
    WAIT: "{:.0%}",
    RATE_RATIO: "{:.0%}",
    UTILIZATION: "{:.0f}%",
    SPREAD: "{:.0f} points",
    MEMORY: "{:.2f}x",
    EFFICIENCY: "{:.0%}",
}


# The report's table


TABLE_COLUMNS = ["notebook", "devices", "kind", "verdict", "key number", "first try"]


def diagnoses(records: list[dict]) -> list[tuple[dict, Diagnosis]]:
    """The newest training record of each notebook (and variant), device count, kind and precision, diagnosed with
    the in-RAM benchmark written nearest in time to it and the newest one-device training run of the same notebook,
    kind and precision."""
    trained = [record for record in records if record["data"] != results.IN_RAM]
    in_ram = [record for record in records if record["data"] == results.IN_RAM]
    newest = {}
    for record in sorted(trained, key=lambda r: r["timestamp"]):
        newest[_key(record)] = record
    found = []
    for (name, devices, kind, precision), record in sorted(newest.items(), key=lambda item: item[0][:2]):
        same = [r for r in in_ram if _key(r) == (name, devices, kind, precision)]
        benchmark = min(same, key=lambda r: abs(_when(r) - _when(record)), default=None)
        single = newest.get((name, 1, kind, precision)) if devices > 1 else None
        found.append((record, diagnose(record, benchmark, single["images_per_second"] if single else None)))
    return found


def table(records: list[dict]) -> pd.DataFrame:
    """One row per notebook run (see :func:`diagnoses`): notebook, devices, kind, verdict, key number, first try."""
    rows = [
        [results.label(r), r["devices"], r["device_kind"], found.verdict, found.key_number, found.first_try]
        for r, found in diagnoses(records)
    ]
    return pd.DataFrame(rows, columns=TABLE_COLUMNS)


def show(paths) -> None:
    """Print the diagnosis of each training run among the records a notebook just wrote (``paths``, from
    :func:`common.measure.results.write_all`: none in a worker that is not the chief, which then prints nothing)."""
    for record, found in diagnoses([results.load(path) for path in paths]):
        print(f"{results.label(record)} on {record['devices']} device(s)\n{found.describe()}\n")


# What the report prints under the table.
NOTE = (
    "Each run's verdict comes from its own records (`common.measure.diagnosis`): the first of start-up or evaluation"
    " dominated, input-bound, devices unevenly used, communication-bound that its figures show; otherwise the steps"
    " keep the devices busy."
)


def _key(record: dict) -> tuple:
    return results.label(record), record["devices"], record["device_kind"], record.get("precision")


def _when(record: dict) -> float:
    return dt.datetime.fromisoformat(record["timestamp"]).timestamp()
