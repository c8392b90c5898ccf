"""The measuring and bookkeeping behind ``Keras_Speedups``, whose cells write each technique in Keras and TensorFlow's
own terms.

Where Keras' tool differs from PyTorch's (:mod:`common.pytorch.speedups`): a global mixed-precision *policy* instead of
an autocast context, XLA (``model.compile(jit_compile=True)``) instead of ``torch.compile``, ``tf.data``'s parallel
``map`` and ``prefetch`` instead of ``DataLoader`` worker processes, and the TensorFlow profiler. The notebook builds
its models, its ``tf.data`` chain and its profile itself; here every measurement times ``model.fit``, the way the Keras
notebook trains, through :class:`common.keras.callbacks.StepTimer`, and comes back as a
:class:`common.teach.toolbox.Measured` row, and the profile is read into a table and a Chrome trace.
"""

from __future__ import annotations

import collections
import json
import time
from pathlib import Path

import pandas as pd

from common.keras.callbacks import StepTimer
from common.run import devices
from common.teach import toolbox
from common.tensorflow import utils as tfu
from common.tensorflow.imports import keras, quiet_start_up, tf

LEARNING_RATE = 1e-4  # the speed does not depend on it; kept small so that repeated steps on one batch stay finite
PROFILED_STEPS = 3
PLAIN, XLA = "float32", "XLA (jit_compile=True)"


def use_one_device(kind: str) -> str:
    """Every measurement runs on one device: the first GPU, its memory growing as needed (so the peak is what the
    step needs, not what TensorFlow reserves), or the CPU with all its cores. Call it before TensorFlow starts."""
    if kind == "gpu":
        return tfu.configure_devices(devices.resolve(1))[0]
    return "/cpu:0"


def xla_default(given, kind: str) -> tuple[bool, str | None]:
    """Whether to measure XLA, and why not when so: compiling DenseNet-121 with XLA takes a minute on a CPU."""
    if given is not None:
        return bool(given), None if given else "XLA=False"
    if kind == "gpu":
        return True, None
    return False, "compiling DenseNet-121 with XLA takes a minute or more on a CPU: set XLA=True to measure it anyway"


def first_steps(models: dict[str, keras.Model], batch: int, image_size: int) -> pd.DataFrame:
    """Each model's :func:`first_step`: its loss and seconds."""
    found = {name: first_step(model, batch, image_size) for name, model in models.items()}
    return pd.DataFrame.from_dict(found, orient="index", columns=["first step loss", "first step s"]).rename_axis(
        "model"
    )


def in_ram(batch: int, image_size: int, seed: int = 0) -> tf.data.Dataset:
    """One random batch, repeated: the input pipeline out of the picture."""
    return tf.data.Dataset.from_tensors(tfu.random_batch(batch, image_size, seed)).repeat()


def first_step(model: keras.Model, batch: int, image_size: int) -> tuple[float, float]:
    """The loss and the seconds of the model's first ``model.fit`` step on the benchmark's batch: the step's tracing,
    and with XLA its compilation, done once here for every later ``fit`` on batches of this shape. Two models built
    from the same seed start from the same weights, so their first losses differ only by how the step is computed."""
    start = time.perf_counter()
    with quiet_logs():
        history = model.fit(in_ram(batch, image_size), steps_per_epoch=1, epochs=1, verbose=0, shuffle=False)
    return history.history["loss"][0], time.perf_counter() - start


def measure(technique: str, setting: str, model, data, batch: int, steps: int, warmup: int = 2, **extra):
    """Time ``steps`` steps of ``model.fit`` on ``data`` after ``warmup`` ones timed apart; the peak memory (GPUs)."""
    gpu = bool(tf.config.list_logical_devices("GPU"))
    if gpu:
        tf.config.experimental.reset_memory_stats("GPU:0")
    timer, began = StepTimer(batch, warmup), time.time()
    model.fit(data, steps_per_epoch=steps + warmup, epochs=1, callbacks=[timer], verbose=0, shuffle=False)
    rate = timer.images_per_second
    first = time.time() - began - steps * batch / rate
    peak = tf.config.experimental.get_memory_info("GPU:0")["peak"] / 2**20 if gpu else None
    return toolbox.Measured(technique, setting, batch, rate, first, peak, None, began, time.time(), extra)


def sweep_batches(model, batches, image_size: int, steps: int) -> list[toolbox.Measured]:
    """Images/s and peak memory at each of ``batches`` (ascending) on the same model, stopping at the first that
    does not fit: the largest batch is found, not guessed. Each new batch shape is traced anew (its first steps)."""
    rows = []
    for batch in batches:
        try:
            rows.append(measure("batch size", f"batch {batch}", model, in_ram(batch, image_size), batch, steps))
        except tf.errors.ResourceExhaustedError as error:
            why = f"out of memory: {str(error).splitlines()[0][:60]}"
            rows.append(toolbox.not_measured("batch size", f"batch {batch}", batch, why))
            break
    return rows


def precisions(plain: toolbox.Measured, models, batch: int, image_size: int, steps: int, kind: str):
    """The float32 policy (``plain``, measured already) against mixed_bfloat16 and mixed_float16 with loss scaling."""
    rows = [toolbox.Measured(**{**vars(plain), "technique": "precision", "setting": PLAIN})]
    for policy in ("mixed_bfloat16", "mixed_float16"):
        if policy not in models:
            rows.append(toolbox.not_measured("precision", policy, batch, "float16 compute needs a GPU"))
            continue
        rows.append(measure("precision", policy, models[policy], in_ram(batch, image_size), batch, steps))
    return rows


def compilers(plain: toolbox.Measured, models, first: pd.DataFrame, batch: int, image_size: int, steps: int, why_not):
    """The traced graph (``plain``, measured already) against the XLA-compiled step. Both rows' first steps include
    the model's first step (:func:`first_steps`): the tracing, and XLA's compilation."""
    none = toolbox.Measured(**{**vars(plain), "technique": "compiler", "setting": "none (traced graph)"})
    none.first_steps_seconds += first.loc[PLAIN, "first step s"]
    if XLA not in models:
        return [none, toolbox.not_measured("compiler", XLA, batch, why_not)]
    row = measure("compiler", XLA, models[XLA], in_ram(batch, image_size), batch, steps)
    row.first_steps_seconds += first.loc[XLA, "first step s"]
    return [none, row]


def check_compiled(first: pd.DataFrame) -> pd.DataFrame:
    """The XLA-compiled model's first loss against the traced graph's, from the same weights (:func:`first_steps`);
    an empty table when XLA was not measured."""
    losses = first["first step loss"]
    rows = {f"{XLA} (loss)": abs(losses[XLA] - losses[PLAIN])} if XLA in losses else {}
    return pd.DataFrame({"largest difference": rows}, dtype=float).rename_axis("against the plain step")


# ---------------------------------------------------------------- the TensorFlow profiler


def profile_dir(folder) -> Path:
    """A new folder under ``folder`` for one profile: TensorBoard's profile plugin (XProf) lists each run by it."""
    return Path(folder) / f"keras-speedups-{time.strftime('%Y%m%d-%H%M%S')}"


def quiet_logs():
    """Pass on what TensorFlow writes to file descriptor 2 inside the block, but its INFO lines: the profiler logs its
    session there, and XLA its start and first compile."""
    return quiet_start_up(gpu_present=bool(devices.gpu_names()))


def read_profile(folder, steps: int) -> tuple[pd.DataFrame, Path]:
    """The profile the TensorFlow profiler wrote into ``folder`` over ``steps`` steps: the top operations by device
    time (by time on the host's compute threads on a CPU) as a table, and its events as a Chrome trace for
    chrome://tracing or Perfetto, written next to it, whose path is returned."""
    space = xspace(next(Path(folder).rglob("*.xplane.pb")))
    trace = Path(folder) / "trace.json"
    trace.write_text(json.dumps(chrome_trace(space)))
    return top_operations(space, steps), trace


def xspace(path):
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    space.ParseFromString(Path(path).read_bytes())
    return space


def _op_type(name: str) -> str | None:
    """``"model/conv1/Conv2D:Conv2D"`` -> ``"Conv2D"``: TensorFlow names an op's event ``<node>:<op type>``. A call
    of a whole function (the training step) holds the ops inside it: it is not an op of its own."""
    node, _, kind = name.rpartition(":")
    if not node or not kind or "::" in name or kind.strip().startswith("__") or kind.endswith("PartitionedCall"):
        return None
    return kind


def _tf_op(plane, event) -> str | None:
    """The TensorFlow op an event ran for: its ``tf_op`` statistic (GPU kernels carry one), or its own name."""
    for stat in event.stats:
        if plane.stat_metadata[stat.metadata_id].name == "tf_op":
            return _op_type(stat.str_value or plane.stat_metadata[stat.ref_value].name)
    return _op_type(plane.event_metadata[event.metadata_id].name)


def top_operations(space, steps: int, count: int = 12) -> pd.DataFrame:
    """Milliseconds per step of each op type: kernels on a GPU's streams where the profile has a GPU, else the ops
    the host's compute threads ran (nested events are inside their op's own and are not counted twice)."""
    device = [plane for plane in space.planes if plane.name.startswith("/device:GPU")]
    planes = device or [plane for plane in space.planes if plane.name == "/host:CPU"]
    total = collections.Counter()
    for plane in planes:
        for line in plane.lines:
            if device and not line.name.startswith("Stream"):
                continue
            for event in line.events:
                kind = _tf_op(plane, event)
                if kind:
                    total[kind] += event.duration_ps / 1e9
    unit = "device" if device else "host"
    frame = pd.DataFrame(total.most_common(count), columns=["operation", f"{unit} ms per step"])
    frame[f"{unit} ms per step"] /= steps
    frame["share"] = frame[f"{unit} ms per step"] * steps / (sum(total.values()) or 1)
    return frame.set_index("operation").round(3)


def chrome_trace(space) -> dict:
    """The profile's events in the Chrome trace format (microseconds), one process per plane, one thread per line."""
    events = []
    for pid, plane in enumerate(space.planes):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": plane.name}})
        for line in plane.lines:
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": line.id, "args": {"name": line.name}})
            for event in line.events:
                events.append(
                    {
                        "ph": "X",
                        "name": plane.event_metadata[event.metadata_id].name,
                        "pid": pid,
                        "tid": line.id,
                        "ts": line.timestamp_ns / 1e3 + event.offset_ps / 1e6,
                        "dur": event.duration_ps / 1e6,
                    }
                )
    return {"traceEvents": events, "displayTimeUnit": "ms"}
