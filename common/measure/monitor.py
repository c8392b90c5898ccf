"""Per-device utilization and memory over time, sampled in a background thread.

On GPUs it reads NVML (the ``pynvml`` module of ``nvidia-ml-py``). Without a
GPU the simulated devices share one set of cores and one memory, so it reports
the machine as one device ``cpu``: utilization of all cores, and the memory
of this process and everything it started (the training workers).

In a notebook, a :class:`LiveView` shows what the devices do while the cell runs, redrawn in place like
``nvidia-smi``, and a one-line summary when the cell's work ends.
"""

from __future__ import annotations

import threading
import time

import pandas as pd
import psutil

from common.measure import plots
from common.run import devices

COLUMNS = ("seconds", "device", "utilization_percent", "memory_mib")


class NVMLBackend:
    """The GPUs of ``uuids`` (a run's :attr:`common.run.devices.Devices.uuids`), ``gpu:0`` the first, or without
    them every GPU that NVML can read; ``handles`` are those it found, with their labels."""

    kind = "gpu"

    def __init__(self, nvml=None, uuids: tuple[str, ...] = ()):
        if nvml is None:
            import pynvml as nvml
        self.nvml = nvml
        nvml.nvmlInit()
        found = {gpu.uuid: handle for gpu, handle in devices.nvml_devices(nvml)}
        self.handles = [(f"gpu:{index}", found[uuid]) for index, uuid in enumerate(uuids or found) if uuid in found]

    def sample(self) -> list[tuple[str, float, float]]:
        rows = []
        for label, handle in self.handles:
            try:
                utilization = self.nvml.nvmlDeviceGetUtilizationRates(handle).gpu
                memory = self.nvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20
            except Exception:  # NVML raises for a GPU gone or hidden since, and for a MIG slice's utilization
                continue
            rows.append((label, float(utilization), float(memory)))
        return rows

    def close(self) -> None:
        self.nvml.nvmlShutdown()


class CPUBackend:
    kind = "cpu"

    def __init__(self, process: psutil.Process | None = None):
        self.process = process or psutil.Process()
        psutil.cpu_percent()  # the first call only starts the measuring interval

    def _tree_memory(self) -> float:
        """Proportional set size: pages shared between forked workers are counted once, not per process."""
        total = 0
        for proc in [self.process, *self.process.children(recursive=True)]:
            try:
                info = proc.memory_full_info()
                total += getattr(info, "pss", info.rss)  # PSS is Linux-only
            except psutil.Error:  # a worker that just exited, or no permission
                pass
        return total / 2**20

    def sample(self) -> list[tuple[str, float, float]]:
        return [("cpu", psutil.cpu_percent(), self._tree_memory())]

    def close(self) -> None:
        pass


def default_backend(hardware=None):
    """NVML for the GPUs of ``hardware`` (a :class:`common.run.devices.Devices`; all GPUs without it) when it finds
    any, the CPU fallback otherwise, and for simulated devices."""
    if hardware is not None and hardware.simulated:
        return CPUBackend()
    try:
        backend = NVMLBackend(uuids=getattr(hardware, "uuids", ()))
    except Exception:  # no pynvml, no driver: NVML raises its own error types
        return CPUBackend()
    if backend.handles:
        return backend
    backend.close()
    return CPUBackend()


class Samples:
    """What a :class:`Monitor` recorded: ``frame()``, ``summary()``, ``plot()``, and ``window()`` for part of it."""

    def __init__(self, rows: list[tuple] | None = None, started: float | None = None):
        self.rows: list[tuple] = rows if rows is not None else []
        self.started = started  # Unix seconds: puts the samples on the time axis of common.measure.phases

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows, columns=list(COLUMNS))

    def summary(self) -> dict[str, dict[str, float]]:
        return summarize(self.frame())

    def plot(self, title: str = "", phases=None):
        """Utilization and memory over time, with the run's phases (a :class:`common.measure.phases.Phases`) behind
        them."""
        return plots.utilization(self.frame(), title, phases.rows() if phases is not None else None, self.started)

    def window(self, start: float, end: float) -> Samples:
        """The samples taken from ``start`` to ``end`` (Unix seconds), for one part of what was monitored."""
        begin, stop = start - self.started, end - self.started
        return Samples([row for row in self.rows if begin <= row[0] <= stop], self.started)


def in_notebook() -> bool:
    """True inside a Jupyter kernel, where a display can be redrawn in place."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return getattr(get_ipython(), "kernel", None) is not None


class LiveView:
    """Each device's utilization and memory as a few lines of text, redrawn in place at most every ``every`` seconds;
    on simulated CPU devices also every core's utilization, since the devices share them. It is created above the
    cell's progress output: a display created later would cut a progress bar in two."""

    def __init__(self, kind: str, every: float = 2.0, display=None):
        from IPython.display import Pretty

        if display is None:
            from IPython.display import display
        self.kind, self.every, self._shown, self._text = kind, every, 0.0, Pretty  # first redraw after `every`
        self.handle = display(Pretty(f"devices: watching, redrawn every {every:g} s"), display_id=True)
        if kind == "cpu":
            psutil.cpu_percent(percpu=True)  # starts the per-core interval (apart from the backend's total)

    def show(self, seconds: float, rows: list[tuple[str, float, float]]) -> None:
        """Redraw with the newest sample (``rows`` as a backend's ``sample()``), unless the last was under ``every``
        seconds ago."""
        if seconds - self._shown < self.every:
            return
        self._shown = seconds
        lines = [f"{name:<6} {bar(utilization)} {utilization:3.0f}%   {memory / 1024:6.2f} GiB" for name, utilization,
                 memory in rows]  # fmt: skip
        if self.kind == "cpu":
            cores = psutil.cpu_percent(percpu=True)
            lines.append("cores  " + " ".join(f"{core:3.0f}%" for core in cores))
        self.handle.update(self._text(f"devices at {seconds:5.0f} s\n" + "\n".join(lines)))

    def close(self, summary: dict[str, dict[str, float]]) -> None:
        """Replace the live lines by one: mean utilization and peak memory of each device while it watched."""
        parts = [f"{name} {value['utilization_mean_percent']:.0f}% busy, peak {value['memory_peak_mib'] / 1024:.2f} GiB"
                 for name, value in summary.items()]  # fmt: skip
        self.handle.update(self._text("devices while this ran: " + ("; ".join(parts) or "no sample")))


def bar(percent: float, width: int = 20) -> str:
    filled = round(max(0.0, min(percent, 100.0)) / 100 * width)
    return "[" + "#" * filled + "." * (width - filled) + "]"


class Monitor(Samples):
    """``with Monitor(hardware) as monitor: train()``, then ``monitor.frame()``, ``summary()``, ``plot()``.

    ``hardware``: the run's :class:`common.run.devices.Devices`, whose devices alone it watches (without it, every GPU
    NVML reads); ``live``: show a :class:`LiveView` while it watches; None shows one inside a notebook only."""

    def __init__(self, hardware=None, interval: float = 0.5, backend=None, live: bool | None = None):
        super().__init__()
        self.interval = interval
        self.backend = backend or default_backend(hardware)
        self.live = in_notebook() if live is None else live
        self._view: LiveView | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def kind(self) -> str:
        return self.backend.kind

    def _run(self) -> None:
        if self.started is None:  # entered again, it goes on with the same time axis
            self.started = time.time()
        while True:
            now = time.time() - self.started
            sample = self.backend.sample()
            self.rows.extend((now, *row) for row in sample)
            if self._view is not None:
                self._view.show(now, sample)
            if self._stop.wait(self.interval):
                return

    def start(self) -> Monitor:
        self._stop.clear()
        self._began = time.time()
        self._view = LiveView(self.kind) if self.live else None
        self._thread = threading.Thread(target=self._run, name="device-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        if self._view is not None:
            self._view.close(self.window(self._began, time.time()).summary())
            self._view = None

    def __enter__(self) -> Monitor:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def summarize(frame: pd.DataFrame) -> dict[str, dict[str, float]]:
    """Mean utilization and peak memory of each device."""
    grouped = frame.groupby("device")
    return {
        device: {
            "utilization_mean_percent": round(float(group["utilization_percent"].mean()), 1),
            "memory_peak_mib": round(float(group["memory_mib"].max()), 1),
        }
        for device, group in grouped
    }
