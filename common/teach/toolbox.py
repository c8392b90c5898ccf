"""The speed-up toolbox's framework-neutral half: measured rows, their tables, plots, costs and verdict.

``PyTorch_Speedups`` (:mod:`common.pytorch.speedups`) and ``Keras_Speedups`` (:mod:`common.tensorflow.speedups`) measure
each way of training faster in their framework's own terms; both report through this module, so a row means the same in
both. Every measurement is one :class:`Measured` row: images/s of the timed steps, the seconds the first steps took
(allocation, autotuning, tracing, compilation: reported apart from the steady state), and the device's peak memory (GPUs
only). What a machine cannot measure is a row whose ``not_measured`` says why, never a made-up number.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import pandas as pd

from common.errors import InputError

# The full data set: the cost of an epoch is for all of it, whatever subset the notebook measured on.
FULL_DATA_SET_IMAGES = 112_120


@dataclass
class Measured:
    """One configuration's measurement; ``not_measured`` says why a row has no figures."""

    technique: str
    setting: str
    batch: int
    images_per_second: float | None = None
    first_steps_seconds: float | None = None
    peak_memory_mib: float | None = None
    not_measured: str | None = None
    start: float | None = None  # Unix seconds: the monitor's samples of this measurement
    end: float | None = None
    extra: dict = field(default_factory=dict)


def not_measured(technique: str, setting: str, batch: int, why: str) -> Measured:
    return Measured(technique, setting, batch, not_measured=why)


def table(rows: list[Measured]) -> pd.DataFrame:
    """The rows as a table for reading: one line per technique and setting, the columns that say something."""
    names = {"images_per_second": "images/s", "first_steps_seconds": "first steps s", "peak_memory_mib": "peak MiB",
             "not_measured": "not measured, because"}  # fmt: skip
    frame = pd.DataFrame([{**asdict(row), **row.extra} for row in rows]).drop(columns=["extra", "start", "end"])
    frame = frame.set_index(["technique", "setting"]).rename(columns=names).dropna(axis=1, how="all")
    return frame.round(2).astype(object).where(frame.notna(), "")


def batch_sizes(given, kind: str, largest_cpu: int) -> list[int]:
    """The batch sweep: ``given``, or doubling from 16 to 1024 on a GPU (it stops at the first that does not fit),
    or 4 up to ``largest_cpu`` on a CPU, where memory is the machine's and a sweep to the limit would take hours."""
    if given is not None:
        if not given or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in given):
            raise InputError(f"BATCH_SIZES must be positive integers, got {given!r}: for example [16, 32, 64].")
        return sorted(given)
    if kind == "gpu":
        return [16 * 2**i for i in range(7)]
    return [b for b in (4, 8, 16, 32, 64) if b <= largest_cpu]


def largest_batch(rows: list[Measured]) -> int | None:
    fitted = [row.batch for row in rows if row.images_per_second]
    return max(fitted) if fitted else None


def stopped_because(rows: list[Measured]) -> str:
    """Why the batch sweep ended where it did: the largest batch is found, not guessed."""
    limit = "the next ran out of memory" if rows[-1].not_measured else "the sweep stopped before the memory did"
    return f"largest batch that fit: {largest_batch(rows)} ({limit})"


def costs(rows: list[Measured], price: float, spot_price: float, epochs: int) -> pd.DataFrame:
    """Hours and price of one epoch of the full data set, and of ``epochs`` of them, for every measured row (a
    row measured on several devices pays for each)."""
    found = []
    for row in rows:
        if not row.images_per_second:
            continue
        devices = row.extra.get("devices", 1)
        hours = FULL_DATA_SET_IMAGES / row.images_per_second / 3600
        found.append(
            {
                "technique": row.technique,
                "setting": row.setting,
                "images/s": row.images_per_second,
                "hours per epoch": hours,
                "price per epoch": hours * devices * price,
                "spot price per epoch": hours * devices * spot_price,
                f"price of {epochs} epochs": hours * devices * price * epochs,
            }
        )
    return pd.DataFrame(found).set_index(["technique", "setting"])


def cheapest(prices: pd.DataFrame) -> str:
    """The cheapest configuration of :func:`costs`, named from its numbers."""
    best = prices["price per epoch"].idxmin()
    return (
        f"cheapest: {' / '.join(best)}, {prices.loc[best, 'price per epoch']:.2f} per epoch on demand, "
        f"{prices.loc[best, 'spot price per epoch']:.2f} on a spot machine"
    )


def what_each_bought(rows: list[Measured], baseline: Measured) -> pd.DataFrame:
    """Per technique measured in two settings or more on one device, its fastest setting against the baseline (the
    default batch in the notebook's precision, no compiler, one batch in memory): speed-up and memory."""
    one_device = [row for row in rows if row.images_per_second and row.extra.get("devices", 1) == 1]
    settings = pd.Series([row.technique for row in one_device]).value_counts()
    best = {}
    for row in one_device:
        if settings[row.technique] < 2:
            continue
        if row.technique not in best or row.images_per_second > best[row.technique][0]:
            best[row.technique] = (row.images_per_second, row)
    lines = []
    for technique, (rate, row) in best.items():
        memory = (
            row.peak_memory_mib / baseline.peak_memory_mib if row.peak_memory_mib and baseline.peak_memory_mib else None
        )
        lines.append(
            {
                "technique": technique,
                "fastest setting": row.setting,
                "images/s": rate,
                "speed-up": rate / baseline.images_per_second,
                "peak memory vs baseline": memory,
            }
        )
    return pd.DataFrame(lines).set_index("technique").sort_values("speed-up", ascending=False)


def recommendation(bought: pd.DataFrame, checks: pd.DataFrame, kind: str, more=()) -> list[str]:
    """What to do first on this machine, from this run's numbers; ``more`` are the framework's own lines."""
    lines = []
    faster = bought[bought["speed-up"] > 1.05]
    for technique, row in faster.iterrows():
        lines.append(f"{technique}: {row['fastest setting']} trains {row['speed-up']:.2f}x as fast as the baseline.")
    slower = bought[bought["speed-up"] < 0.95].index.tolist()
    if slower:
        lines.append(f"On this machine no setting of {', '.join(slower)} beat the baseline: leave them at the default.")
    lines += list(more)
    if len(checks):
        worst = checks["largest difference"].max()
        lines.append(f"The tricks that change the arithmetic computed the plain step to within {worst:.1e} (Evaluate).")
    if kind == "cpu":
        lines.append("These are CPU figures: the GPU-only rows (fp16, cuDNN, device memory) need a GPU to decide.")
    return lines


def conclude(rows: list[Measured], baseline: Measured, checks: pd.DataFrame, kind: str, more=()) -> pd.DataFrame:
    """The notebook's last word: print the :func:`recommendation` and what this machine could not measure, and return
    :func:`what_each_bought` for display."""
    bought = what_each_bought(rows, baseline)
    for line in recommendation(bought, checks, kind, more):
        print("*", line)
    for what, why in not_measured_fields(rows).items():
        print(f"  not measured here, {what}: {why}")
    return bought.round(2)


def fields(row: Measured) -> dict:
    """A measured row as the fields of its results record."""
    return {
        "variant": f"{row.technique}: {row.setting}",
        "global_batch": row.batch * row.extra.get("devices", 1),
        "devices": row.extra.get("devices", 1),
        "first_steps_seconds": row.first_steps_seconds,
        "peak_memory_mib": row.peak_memory_mib,
    }


def not_measured_fields(rows: list[Measured]) -> dict[str, str]:
    """``{"technique: setting": why}`` of the rows this machine could not measure, for the records."""
    return {f"{row.technique}: {row.setting}": row.not_measured for row in rows if row.not_measured}


def records(run, rows: list[Measured], monitor) -> list:
    """One benchmark record per measured row of ``run`` (a :class:`common.measure.results.Run`), each with the
    utilization the ``monitor`` sampled while it ran."""
    return [
        run.benchmark(row.images_per_second, monitor.window(row.start, row.end), **fields(row))
        for row in rows
        if row.images_per_second
    ]


# ---------------------------------------------------------------- plots


def plot_sweep(rows: list[Measured], title: str):
    """Images/s (left axis) and peak memory (right axis, GPUs) against the batch."""
    import matplotlib.pyplot as plt

    fitted = [row for row in rows if row.images_per_second]
    figure, axis = plt.subplots(figsize=(6, 3.5))
    axis.plot([r.batch for r in fitted], [r.images_per_second for r in fitted], marker="o", label="images/s")
    axis.set(xscale="log", xlabel="batch (images)", ylabel="images / second", title=title)
    axis.set_xticks([r.batch for r in fitted], [str(r.batch) for r in fitted])
    if any(r.peak_memory_mib for r in fitted):
        memory = axis.twinx()
        memory.plot([r.batch for r in fitted], [r.peak_memory_mib / 1024 for r in fitted], "s--", color="C1")
        memory.set(ylabel="peak memory GiB (squares)")
    figure.tight_layout()
    return figure


def plot_speedups(rows: list[Measured], title: str):
    """Each setting's speed-up over the first row (fp32 in the default layout)."""
    import matplotlib.pyplot as plt

    base = rows[0].images_per_second
    shown = [row for row in rows if row.images_per_second]
    figure, axis = plt.subplots(figsize=(6, 3.5))
    axis.barh([row.setting for row in shown][::-1], [row.images_per_second / base for row in shown][::-1])
    axis.axvline(1, color="k", linewidth=0.8)
    axis.set(xlabel=f"speed-up over {rows[0].setting}", title=title)
    figure.tight_layout()
    return figure


def plot_pipeline(rows: list[Measured], ceiling: Measured, title: str, key: str, xlabel: str, label: str):
    """Images/s against the input pipeline's parallelism (``row.extra[key]``), with the in-memory ceiling."""
    import matplotlib.pyplot as plt

    plain = [row for row in rows if key in row.extra]
    figure, axis = plt.subplots(figsize=(6, 3.5))
    axis.plot([r.extra[key] for r in plain], [r.images_per_second for r in plain], marker="o", label=label)
    axis.axhline(ceiling.images_per_second, color="k", linestyle="--", label="one batch in memory (the ceiling)")
    axis.set(xlabel=xlabel, ylabel="images / second", title=title)
    axis.legend(loc="lower right", fontsize="small")
    figure.tight_layout()
    return figure
