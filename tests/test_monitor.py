import sys
import time
from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import psutil  # noqa: E402
import pytest  # noqa: E402

from common.measure import monitor, plots  # noqa: E402
from common.run import devices  # noqa: E402


class FakeNVML:
    """GPUs whose utilization (%) and used memory (MiB) follow a script, one value per sample; a value that is an
    exception is raised instead. GPU i has the UUID ``GPU-i``; those in ``denied`` NVML refuses (NO_PERMISSION)."""

    def __init__(self, utilization, memory_mib, denied=()):
        self.utilization = {index: iter(values) for index, values in utilization.items()}
        self.memory = {index: iter(values) for index, values in memory_mib.items()}
        self.denied = set(denied)
        self.initialized = self.shut_down = False

    def nvmlInit(self):
        self.initialized = True

    def nvmlDeviceGetCount(self):
        return len(self.utilization)

    def nvmlDeviceGetHandleByIndex(self, index):
        if index in self.denied:
            raise PermissionError("NVMLError_NoPermission")
        return index

    def nvmlDeviceGetPciInfo(self, handle):
        return SimpleNamespace(busId=f"00000000:{0x18 + handle:02X}:00.0")

    def nvmlDeviceGetName(self, handle):
        return "NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetUUID(self, handle):
        return f"GPU-{handle}"

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=scripted(self.utilization[handle]), memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle):
        memory = self.memory[handle]

        class Memory:  # used: read when sampled, not when the GPUs are found
            total, free = 80 * 2**30, 70 * 2**30
            used = property(lambda _: scripted(memory) * 2**20)

        return Memory()

    def nvmlShutdown(self):
        self.shut_down = True


def scripted(values):
    value = next(values)
    if isinstance(value, Exception):
        raise value
    return value


def two_gpus():
    return FakeNVML(
        utilization={0: [10, 30, 50, 70], 1: [90, 90, 90, 90]},
        memory_mib={0: [100, 400, 200, 300], 1: [1000, 1000, 1000, 1000]},
    )


def test_nvml_backend_samples_every_gpu():
    nvml = two_gpus()
    backend = monitor.NVMLBackend(nvml)
    assert nvml.initialized and backend.kind == "gpu"
    assert backend.sample() == [("gpu:0", 10.0, 100.0), ("gpu:1", 90.0, 1000.0)]
    backend.close()
    assert nvml.shut_down


def test_nvml_backend_samples_only_the_runs_gpus_labelled_in_the_runs_order():
    nvml = FakeNVML(utilization={0: [10], 1: [20], 2: [30]}, memory_mib={0: [100], 1: [200], 2: [300]})
    backend = monitor.NVMLBackend(nvml, uuids=("GPU-2", "GPU-0"))
    assert backend.sample() == [("gpu:0", 30.0, 300.0), ("gpu:1", 10.0, 100.0)]


def test_nvml_backend_leaves_out_gpus_nvml_may_not_read_and_readings_that_fail():
    """A cluster's cgroup hides GPU 0 (NVML refuses its handle); GPU 2's reading fails once (a GPU lost, say)."""
    nvml = FakeNVML(
        utilization={0: [], 1: [10, 20], 2: [RuntimeError("NVMLError_GpuIsLost"), 40]},
        memory_mib={0: [], 1: [100, 200], 2: [400]},  # not read when the utilization fails
        denied={0},
    )
    backend = monitor.NVMLBackend(nvml)
    assert backend.sample() == [("gpu:0", 10.0, 100.0)]
    assert backend.sample() == [("gpu:0", 20.0, 200.0), ("gpu:1", 40.0, 400.0)]


def test_a_monitor_of_a_runs_devices_watches_only_those(monkeypatch):
    nvml = FakeNVML(utilization={0: [10] * 9, 1: [90] * 9}, memory_mib={0: [100] * 9, 1: [1000] * 9})
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    one = devices.Devices("gpu", 1, 2, ("NVIDIA H100 80GB HBM3",), 80.0, (9, 0), 70.0, ("GPU-1",))
    with monitor.Monitor(one, interval=60) as watcher:
        pass
    assert watcher.summary() == {"gpu:0": {"utilization_mean_percent": 90.0, "memory_peak_mib": 1000.0}}
    with monitor.Monitor(interval=60) as everything:  # without the run's devices: every GPU
        pass
    assert set(everything.summary()) == {"gpu:0", "gpu:1"}
    simulated = devices.resolve(2, gpus=[], cores=2)  # GPUs hidden from the run (CUDA_VISIBLE_DEVICES=)
    assert monitor.Monitor(simulated).kind == "cpu"


def test_default_backend_falls_back_to_cpu_when_nvml_may_read_no_gpu(monkeypatch):
    nvml = FakeNVML(utilization={0: [], 1: []}, memory_mib={0: [], 1: []}, denied={0, 1})
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert isinstance(monitor.default_backend(), monitor.CPUBackend) and nvml.shut_down


def test_monitor_collects_rows_per_gpu_and_summarizes_means_and_peaks():
    watcher = monitor.Monitor(interval=60, backend=monitor.NVMLBackend(two_gpus()))
    assert watcher.kind == "gpu"
    for _ in range(4):  # each start samples once at once; stop ends the wait
        with watcher:
            pass
    frame = watcher.frame()
    assert list(frame.columns) == list(monitor.COLUMNS)
    assert frame["device"].value_counts().to_dict() == {"gpu:0": 4, "gpu:1": 4}
    assert watcher.summary() == {
        "gpu:0": {"utilization_mean_percent": 40.0, "memory_peak_mib": 400.0},
        "gpu:1": {"utilization_mean_percent": 90.0, "memory_peak_mib": 1000.0},
    }


def test_summarize_rounds_to_one_decimal():
    frame = pd.DataFrame(
        [(0.0, "cpu", 10.0, 1.04), (1.0, "cpu", 20.0, 2.06), (2.0, "cpu", 20.0, 1.0)], columns=list(monitor.COLUMNS)
    )
    assert monitor.summarize(frame) == {"cpu": {"utilization_mean_percent": 16.7, "memory_peak_mib": 2.1}}


def test_cpu_backend_reports_one_cpu_device():
    backend = monitor.CPUBackend()
    time.sleep(0.05)
    ((device, utilization, memory),) = backend.sample()
    assert device == "cpu"
    assert 0.0 <= utilization <= 100.0
    assert memory > 1.0  # MiB: at least this Python process
    assert backend.kind == "cpu"


def test_monitor_with_a_short_interval_collects_several_rows_and_stops():
    watcher = monitor.Monitor(interval=0.01, backend=monitor.CPUBackend()).start()
    deadline = time.monotonic() + 5
    while len(watcher.rows) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    watcher.stop()
    frame = watcher.frame()
    assert len(frame) >= 5
    assert set(frame["device"]) == {"cpu"}
    assert frame["seconds"].is_monotonic_increasing
    rows = len(watcher.rows)
    time.sleep(0.05)
    assert len(watcher.rows) == rows  # stopped: no more samples


def test_stop_without_start_is_harmless():
    watcher = monitor.Monitor(interval=0.01, backend=monitor.CPUBackend())
    watcher.stop()
    assert watcher.frame().empty


def test_default_backend_falls_back_to_cpu_without_nvml(monkeypatch):
    def no_nvml(self, nvml=None):
        raise ImportError("No module named 'pynvml'")

    monkeypatch.setattr(monitor.NVMLBackend, "__init__", no_nvml)
    assert isinstance(monitor.default_backend(), monitor.CPUBackend)


@pytest.fixture
def figure():
    watcher = monitor.Monitor(interval=60, backend=monitor.NVMLBackend(two_gpus()))
    for _ in range(3):
        with watcher:
            pass
    fig = watcher.plot("two GPUs")
    yield fig
    plt.close(fig)


def test_plot_returns_a_figure_with_utilization_and_memory(figure):
    assert isinstance(figure, matplotlib.figure.Figure)
    top, bottom = figure.axes
    assert top.get_title() == "two GPUs"
    assert [line.get_label() for line in top.get_lines()] == ["gpu:0", "gpu:1"]
    assert list(top.get_lines()[0].get_ydata()) == [10.0, 30.0, 50.0]
    assert list(bottom.get_lines()[1].get_ydata()) == [1000.0, 1000.0, 1000.0]


def test_plot_shows_only_the_monitored_time_of_phases_that_began_before_or_went_on_after_it():
    started = 1000.0
    frame = pd.DataFrame(
        {"seconds": [0.0, 10.0, 20.0], "device": "cpu", "utilization_percent": 50.0, "memory_mib": [1.0, 2.0, 3.0]}
    )
    phases = [
        {"phase": "start-up", "start": 900.0, "seconds": 50.0},  # over before the monitor started
        {"phase": "data check", "start": 990.0, "seconds": 15.0},  # began before it
        {"phase": "train", "start": 1005.0, "seconds": 10.0},
        {"phase": "test", "start": 1018.0, "seconds": 30.0},  # went on after its last sample
    ]
    fig = plots.utilization(frame, phases=phases, started=started)
    top, _ = fig.axes
    assert top.get_xlim()[0] == 0
    bands = [(band.get_x(), band.get_x() + band.get_width()) for band in top.patches]
    assert bands == [(0.0, 5.0), (5.0, 15.0), (18.0, 20.0)]
    assert [text.get_text() for text in top.get_legend().get_texts()] == ["cpu", "data check", "train", "test"]
    plt.close(fig)


class FakeDisplay:
    """IPython's display with ``display_id=True``: a handle whose every update is kept, as a notebook would redraw."""

    def __init__(self):
        self.shown = []

    def __call__(self, obj, display_id):
        assert display_id is True
        self.shown.append(obj.data)
        return self

    def update(self, obj):
        self.shown.append(obj.data)


def test_the_live_view_redraws_each_device_in_place_at_most_every_two_seconds():
    shown = FakeDisplay()
    view = monitor.LiveView("gpu", every=2.0, display=shown)
    for seconds in (0.0, 0.5, 1.0, 2.0, 2.5, 4.0):
        view.show(seconds, [("gpu:0", 50.0, 2048.0), ("gpu:1", 100.0, 1024.0)])
    assert len(shown.shown) == 3, "the first line, then a redraw at 2 s and at 4 s"
    assert shown.shown[-1].splitlines() == [
        "devices at     4 s",
        "gpu:0  [##########..........]  50%     2.00 GiB",
        "gpu:1  [####################] 100%     1.00 GiB",
    ]
    view.close({"gpu:0": {"utilization_mean_percent": 49.6, "memory_peak_mib": 3072.0}})
    assert shown.shown[-1] == "devices while this ran: gpu:0 50% busy, peak 3.00 GiB"


def test_the_live_view_of_simulated_devices_shows_every_core():
    shown = FakeDisplay()
    monitor.LiveView("cpu", display=shown).show(2.0, [("cpu", 75.0, 512.0)])
    cores = shown.shown[-1].splitlines()[-1].split()
    assert cores[0] == "cores" and len(cores) == 1 + psutil.cpu_count() and all(c.endswith("%") for c in cores[1:])


def test_a_monitor_shows_a_live_view_only_when_asked_or_in_a_notebook(monkeypatch):
    assert not monitor.Monitor(backend=monitor.CPUBackend()).live, "pytest is no notebook"
    views = []

    class View:
        def __init__(self, kind):
            self.kind, self.samples, self.summary = kind, 0, None
            views.append(self)

        def show(self, seconds, rows):
            self.samples += 1

        def close(self, summary):
            self.summary = summary

    monkeypatch.setattr(monitor, "LiveView", View)
    with monitor.Monitor(interval=0.05, backend=monitor.CPUBackend(), live=True):
        time.sleep(0.3)
    (view,) = views
    assert view.kind == "cpu" and view.samples >= 2 and set(view.summary) == {"cpu"}
