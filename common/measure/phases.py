"""Where a run's time goes: named phases on one wall clock, shared by a notebook and the processes it launches.

A slow run should show at once whether its time went to the steps, to evaluation, to start-up or to the input
pipeline. Every notebook times the same phases (the names in ``ORDER``); a launched training script times its own
and hands them back (:mod:`common.run.protocol`), and since all use ``time.time()`` they fall on one time axis with the
utilization samples of :mod:`common.measure.monitor`. A phase that repeats (``train`` and ``validate``, once per epoch)
keeps its epoch.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator

import pandas as pd
import psutil

# The phases in the order a run meets them, and what each covers.
ORDER = {
    "start-up": "process start, imports, devices and process group",
    "data check": "reading the labels, splitting, checking every image",
    "model build": "building (and on GPUs placing) the model",
    "check": "a check that the parallel arithmetic equals one device's, before training",
    "launch": "the launcher starting the training processes",
    "first steps": "the first training steps: graph tracing, cuDNN autotuning, allocation",
    "train": "the training steps of an epoch",
    "validate": "scoring the validation split after an epoch",
    "checkpoint": "saving a checkpoint after an epoch",
    "precise BN": "re-estimating the BatchNorm statistics with the final weights",
    "test": "scoring the test split",
    "benchmark warm-up": "the in-RAM benchmark's untimed first steps",
    "benchmark": "the in-RAM benchmark's timed steps",
    "teardown": "leaving the process group, the launched processes exiting",
}


class Phases:
    """``with phases("test"): ...`` times a phase; :meth:`rows` gives them in the results record's form."""

    def __init__(self, rows: Iterable[dict] = ()):
        self._rows: list[dict] = []
        self.extend(rows)

    @classmethod
    def start_up(cls) -> Phases:
        """Start with a ``start-up`` phase until now: from this process's creation, or in a notebook from the moment
        the current cell (Setup) was asked to run, so a kernel that sat idle before does not count."""
        phases = cls()
        phases.add("start-up", max(psutil.Process().create_time(), _cell_requested() or 0), time.time())
        return phases

    @contextlib.contextmanager
    def __call__(self, name: str, epoch: int | None = None) -> Iterator[None]:
        start = time.time()
        try:
            yield
        finally:
            self.add(name, start, time.time(), epoch)

    def add(self, name: str, start: float, end: float, epoch: int | None = None) -> None:
        if name not in ORDER:
            raise ValueError(f"unknown phase {name!r}: one of {', '.join(ORDER)}")
        row = {"phase": name, "start": start, "seconds": max(0.0, end - start)}
        if epoch is not None:
            row["epoch"] = epoch
        self._rows.append(row)

    def extend(self, rows: Iterable[dict]) -> None:
        """Add phases timed elsewhere (a launched script's, as :meth:`rows` gave them there)."""
        for row in rows:
            self.add(row["phase"], row["start"], row["start"] + row["seconds"], row.get("epoch"))

    def add_launched(self, rows: Iterable[dict], launched: float, returned: float) -> None:
        """The phases of launched processes (``rows``, as their rank 0 timed them) between the launch at ``launched``
        and the launcher's return at ``returned``: the launcher's own start and the processes' exit become ``launch``
        and ``teardown``."""
        rows = list(rows)
        if not rows:
            return
        first = min(row["start"] for row in rows)
        last = max(row["start"] + row["seconds"] for row in rows)
        self.add("launch", launched, first)
        self.extend(rows)
        self.add("teardown", last, returned)

    def table(self) -> pd.DataFrame:
        """:func:`table` of the phases so far: in a notebook, its share column is a share of the run so far."""
        return table(self.rows()).rename(columns={"share of run": "share of the run so far"})

    def rows(self) -> list[dict]:
        """``[{"phase", "start" (Unix seconds), "seconds", "epoch" (repeating phases)}]``, in time order."""
        return sorted(self._rows, key=lambda row: row["start"])


BETWEEN = "between phases"  # the rest of the run's span: cells that time nothing, a person's pauses


def table(rows: list[dict]) -> pd.DataFrame:
    """Seconds, count and share of the run's span per phase (repeated phases summed), in ``ORDER``, and a last row
    for the time between the timed phases."""
    frame = pd.DataFrame(rows, columns=["phase", "start", "seconds", "epoch"])
    total = frame.groupby("phase", sort=False)["seconds"].agg(["sum", "count"])
    total = total.reindex([name for name in ORDER if name in total.index])
    out = pd.DataFrame({"seconds": total["sum"], "times": total["count"]})
    span = _span(rows)
    out.loc[BETWEEN] = [max(0.0, span - out["seconds"].sum()), 0]
    out["times"] = out["times"].astype(int)
    out["share of run"] = out["seconds"] / span if span else float("nan")
    out.index.name = "phase"
    return out


# The steady steps; their warm-ups (tracing, autotuning, compiling) are start-up costs a longer run pays once.
STEPS = ("train", "benchmark")


def steps_share(rows: list[dict]) -> float | None:
    """The steady steps' (``STEPS``) share of the run's span, from the first phase's start to the last one's end: the
    one figure the phase tables, the report, the diagnosis and the exercises' answers call the steps' share. The rest
    of the span is outside the steps (start-up, evaluation, warm-ups: the diagnosis' figure) or between phases."""
    span = _span(rows)
    return sum(row["seconds"] for row in rows if row["phase"] in STEPS) / span if span else None


def _span(rows: list[dict]) -> float:
    return max(row["start"] + row["seconds"] for row in rows) - min(row["start"] for row in rows) if rows else 0.0


def timed_steps(step, steps: int, wait, phases: Phases | None = None, warmup: int = 2) -> float:
    """Seconds of ``steps`` calls of ``step()`` after ``warmup`` untimed ones (tracing, autotuning, allocation):
    every framework's in-RAM benchmark. ``wait(result)`` blocks until the devices have finished the step that
    returned ``result``; ``phases`` gets the warm-up and the timed steps."""
    began = time.time()
    result = None
    for _ in range(warmup):
        result = step()
    wait(result)
    start, timed = time.time(), time.perf_counter()
    for _ in range(steps):
        result = step()
    wait(result)
    seconds = time.perf_counter() - timed
    if phases is not None:
        phases.add("benchmark warm-up", began, start)
        phases.add("benchmark", start, start + seconds)
    return seconds


class BatchWait:
    """Iterate over a data loader and count the seconds spent waiting for its next batch.

    This is the input pipeline's cost as the training loop feels it: with enough decode workers the next batch is
    ready and the wait is near 0; an input-bound run waits for most of its epoch.
    """

    def __init__(self, batches: Iterable):
        self.batches, self.seconds = batches, 0.0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        iterator = iter(self.batches)
        while True:
            start = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            finally:
                self.seconds += time.perf_counter() - start
            yield batch


def _cell_requested() -> float | None:
    """When the notebook cell now running was sent to the kernel (Unix seconds); None outside a Jupyter kernel."""
    try:
        from IPython import get_ipython

        return get_ipython().kernel.get_parent()["header"]["date"].timestamp()
    except Exception:  # no IPython, no kernel, or a client that sends no date: time from process start
        return None
