import pytest

from common.errors import InputError
from common.run import devices


class FakeNVML:
    """The few pynvml calls gpu_names makes, for a machine with the given GPUs."""

    def __init__(self, names=(), init_error=None, memory_gib=80.0, capability=(9, 0), driver="580.95.05"):
        self.names, self.memory_gib, self.capability, self.driver = list(names), memory_gib, capability, driver
        self.init_error = init_error
        self.shut_down = False

    def nvmlSystemGetDriverVersion(self):
        return self.driver

    def nvmlDeviceGetCudaComputeCapability(self, handle):
        return self.capability

    def nvmlInit(self):
        if self.init_error:
            raise self.init_error

    def nvmlDeviceGetCount(self):
        return len(self.names)

    def nvmlDeviceGetHandleByIndex(self, index):
        return ("handle", index)

    def nvmlDeviceGetName(self, handle):
        return self.names[handle[1]].encode()  # older pynvml returns bytes

    def nvmlDeviceGetMemoryInfo(self, handle):
        return type("Memory", (), {"total": int(self.memory_gib * 2**30)})

    def nvmlShutdown(self):
        self.shut_down = True


# --- resolve: CPU --------------------------------------------------------------


@pytest.mark.parametrize("cores, expected", [(1, 1), (2, 2), (16, 2)])
def test_resolve_on_cpu_defaults_to_min_of_two_and_cores(cores, expected):
    found = devices.resolve(None, gpus=[], cores=cores)
    assert (found.kind, found.count, found.available) == ("cpu", expected, cores)
    assert found.simulated
    assert found.names == tuple(f"cpu:{i}" for i in range(expected))


def test_resolve_on_cpu_honours_requested_count():
    found = devices.resolve(4, gpus=[], cores=8)
    assert (found.kind, found.count) == ("cpu", 4)
    assert "4 simulated CPU device(s) sharing 8 cores (2 thread(s) each)" == found.describe()


def test_resolve_on_cpu_refuses_more_devices_than_cores():
    with pytest.raises(InputError, match=r"DEVICES=3 .* only 2 CPU core\(s\).*set DEVICES to at most 2"):
        devices.resolve(3, gpus=[], cores=2)


# --- resolve: GPU --------------------------------------------------------------


def test_resolve_uses_all_gpus_by_default():
    found = devices.resolve(None, gpus=["A100", "A100", "A100"])
    assert (found.kind, found.count, found.available) == ("gpu", 3, 3)
    assert not found.simulated
    assert found.describe() == "3 of 3 GPU(s): A100, A100, A100"


def test_resolve_uses_the_first_requested_gpus():
    found = devices.resolve(2, gpus=["g0", "g1", "g2", "g3"])
    assert (found.count, found.available, found.names) == (2, 4, ("g0", "g1"))


def test_resolve_refuses_more_devices_than_gpus():
    with pytest.raises(InputError, match=r"DEVICES=4 but this machine has 2 GPU\(s\).*set DEVICES to at most 2"):
        devices.resolve(4, gpus=["H100", "H100"])


@pytest.mark.parametrize("requested", [0, -1, True, False, "2", 1.0])
def test_resolve_rejects_invalid_device_counts(requested):
    with pytest.raises(InputError, match="DEVICES must be a positive integer or None"):
        devices.resolve(requested, gpus=[], cores=4)


# --- NVML discovery --------------------------------------------------------------


def test_gpu_names_decodes_bytes_and_shuts_nvml_down():
    nvml = FakeNVML(["NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"])
    assert devices.gpu_names(nvml) == ["NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"]
    assert nvml.shut_down


def test_gpu_names_is_empty_when_nvml_cannot_start():
    assert devices.gpu_names(FakeNVML(["x"], init_error=RuntimeError("NVML Shared Library Not Found"))) == []


def test_gpu_names_is_empty_without_gpus():
    assert devices.gpu_names(FakeNVML([])) == []


@pytest.mark.parametrize(
    "visible, expected",
    [("1", ["g1"]), ("1,0", ["g1", "g0"]), ("", []), ("GPU-0c5e1d3a", ["g0"])],
)
def test_visible_gpu_names_follows_cuda_visible_devices(monkeypatch, visible, expected):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert devices.visible_gpu_names(FakeNVML(["g0", "g1", "g2"])) == expected


def test_visible_gpu_names_without_cuda_visible_devices_lists_all(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert devices.visible_gpu_names(FakeNVML(["g0", "g1"])) == ["g0", "g1"]


@pytest.mark.parametrize("visible, expected", [("-1", []), ("0,5,1", ["g0"])])
def test_visible_gpu_names_stops_at_an_invalid_index_like_cuda(monkeypatch, visible, expected):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert devices.visible_gpu_names(FakeNVML(["g0", "g1"])) == expected


# --- threads ---------------------------------------------------------------------


@pytest.mark.parametrize("count, cores, expected", [(1, 8, 8), (2, 8, 4), (3, 8, 2), (16, 8, 1), (2, 1, 1)])
def test_threads_per_device_share_the_cores_at_least_one_each(count, cores, expected):
    assert devices.threads_per_device(count, cores) == expected


def test_gpus_report_their_memory_and_compute_capability_and_resolve_keeps_the_smallest():
    (gpu,) = devices.gpus(FakeNVML(["H200"], memory_gib=139.8))
    assert gpu.name == "H200" and gpu.memory_gib == pytest.approx(139.8) and gpu.compute_capability == (9, 0)
    gpus = devices.resolve(2, gpus=["g0", "g1"], memory_gib=40.0, compute_capability=(8, 0))
    assert gpus.memory_gib == 40.0 and gpus.compute_capability == (8, 0)
    cpus = devices.resolve(None, gpus=[], cores=2)
    assert cpus.memory_gib is None and cpus.compute_capability is None


def test_driver_version_comes_from_nvml_and_is_none_without_a_driver():
    assert devices.driver_version(FakeNVML(["H100"], driver="535.104.05")) == "535.104.05"
    assert devices.driver_version(FakeNVML(init_error=RuntimeError("NVML Shared Library Not Found"))) is None


# --- GPUs that a framework cannot use -----------------------------------------------


def test_gpus_a_framework_cannot_use_stop_the_run_naming_driver_build_and_fix(monkeypatch):
    """torch built for CUDA 13 under a 535 driver: torch.cuda.is_available() is False while NVML lists the GPUs."""
    monkeypatch.setattr(devices, "driver_version", lambda: "535.104.05")
    hardware = devices.resolve(None, gpus=["NVIDIA A100-SXM4-80GB"] * 4, memory_gib=80.0)
    with pytest.raises(InputError) as error:
        devices.require_usable(hardware, "torch 2.14.1+cu130", 0, "13.0")
    message = str(error.value)
    for needed in ("4 GPU(s)", "NVIDIA A100-SXM4-80GB", "driver 535.104.05", "torch 2.14.1+cu130",
                   "built for CUDA 13.0, which needs NVIDIA driver 580.65.06 or newer", "make setup",
                   "CUDA_VISIBLE_DEVICES="):  # fmt: skip
        assert needed in message


def test_a_build_without_cuda_is_named_and_enough_usable_gpus_pass(monkeypatch):
    monkeypatch.setattr(devices, "driver_version", lambda: "580.95.05")
    hardware = devices.resolve(2, gpus=["L40S", "L40S"], memory_gib=45.0)
    with pytest.raises(InputError, match=r"TensorFlow 2\.21\.0 \(a build without CUDA\) can use 0 of the 2"):
        devices.require_usable(hardware, "TensorFlow 2.21.0", 0, None)
    devices.require_usable(hardware, "TensorFlow 2.21.0", 2, "12.5")  # usable: nothing to say
    devices.require_usable(devices.resolve(2, gpus=[], cores=4), "TensorFlow 2.21.0", 0, None)  # simulated devices


@pytest.mark.parametrize(
    ("kind", "count", "processes", "cores", "expected"),
    [
        ("cpu", 2, None, 16, 1),  # simulated devices already share the cores
        ("gpu", 1, None, 16, 8),  # at most 8 per device it drives
        ("gpu", 8, None, 16, 1),  # 2 cores per process, one kept for the process itself
        ("gpu", 4, 1, 16, 15),  # one process (Gluon) drives every GPU: all cores but its own
        ("gpu", 2, None, 2, 1),  # never fewer than one
    ],
)
def test_one_loader_workers_rule_for_every_framework(monkeypatch, kind, count, processes, cores, expected):
    monkeypatch.setattr(devices, "cpu_cores", lambda: cores)
    assert devices.loader_workers(kind, count, processes) == expected
