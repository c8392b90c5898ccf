import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from common.errors import InputError
from common.run import devices

ROOT = Path(__file__).resolve().parents[1]


class NoPermission(Exception):
    """pynvml's NVMLError_NoPermission: what NVML raises for a GPU that a cluster's cgroup hides."""


class FakeNVML:
    """The pynvml calls of common.run.devices, for a machine with the given GPUs in NVML's numbering.

    GPU i has the UUID ``GPU-ic5e1d3a-...`` and sits on PCI bus ``buses[i]`` (in NVML's order unless given).
    ``mig`` maps a GPU in MIG mode to its slices (name, total GiB, free GiB), UUIDs ``MIG-<i><slot>...``;
    ``denied`` holds (GPU, call) pairs whose call raises NO_PERMISSION, a call one of "handle", "name", "memory".
    """

    def __init__(self, names=(), init_error=None, memory_gib=80.0, capability=(9, 0), driver="580.95.05", *,
                 free_gib=None, buses=None, mig=None, denied=()):  # fmt: skip
        self.names, self.memory_gib, self.capability, self.driver = list(names), memory_gib, capability, driver
        self.free_gib = memory_gib if free_gib is None else free_gib
        self.buses = buses or [f"00000000:{0x18 + 0x10 * i:02X}:00.0" for i in range(len(self.names))]
        self.mig, self.denied = mig or {}, set(denied)
        self.init_error = init_error
        self.shut_down = False

    def _check(self, handle, call):
        if (handle[1], call) in self.denied:
            raise NoPermission("Insufficient Permissions")

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
        self._check(("gpu", index), "handle")
        return ("gpu", index)

    def nvmlDeviceGetPciInfo(self, handle):
        return SimpleNamespace(busId=self.buses[handle[1]].encode())

    def nvmlDeviceGetName(self, handle):
        self._check(handle, "name")
        if handle[0] == "mig":
            return self.mig[handle[1]][handle[2]][0]
        return self.names[handle[1]].encode()  # older pynvml returns bytes

    def nvmlDeviceGetUUID(self, handle):
        if handle[0] == "mig":
            return f"MIG-{handle[1]}{handle[2]}7e2b9c-0000-5d4e-a1b2-c3d4e5f60718"
        return f"GPU-{handle[1]}c5e1d3a-47b6-2a19-9e0f-8d7c6b5a4e3f"

    def nvmlDeviceGetMemoryInfo(self, handle):
        self._check(handle, "memory")
        total, free = self.mig[handle[1]][handle[2]][1:] if handle[0] == "mig" else (self.memory_gib, self.free_gib)
        return SimpleNamespace(total=int(total * 2**30), free=int(free * 2**30))

    def nvmlDeviceGetMigMode(self, handle):
        if handle[1] not in self.mig:
            raise NotImplementedError("NVMLError_NotSupported")  # a GPU without MIG
        return [1, 1]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle):
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle, index):
        if index >= len(self.mig[handle[1]]):
            raise LookupError("NVMLError_NotFound")  # an empty slot
        return ("mig", handle[1], index)

    def nvmlShutdown(self):
        self.shut_down = True


def uuid(index):
    return FakeNVML().nvmlDeviceGetUUID(("gpu", index))


@pytest.fixture(autouse=True)
def pci_order(monkeypatch):
    """What importing common.run.devices sets, whatever the shell running the tests had."""
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")


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


def test_importing_devices_has_cuda_number_the_gpus_by_pci_bus_as_nvml_does():
    env = {name: value for name, value in os.environ.items() if name != "CUDA_DEVICE_ORDER"}
    code = "import os; from common.run import devices; print(os.environ['CUDA_DEVICE_ORDER'])"
    for given, expected in ((None, "PCI_BUS_ID"), ("FASTEST_FIRST", "FASTEST_FIRST")):  # the user's choice stays
        env.update({"CUDA_DEVICE_ORDER": given} if given else {})
        shown = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True)
        assert shown.stdout.strip() == expected, shown.stderr


@pytest.mark.parametrize("visible, expected", [(None, ["g1", "g0"]), ("0", ["g1"]), ("1,0", ["g0", "g1"])])
def test_cuda_visible_device_numbers_count_the_gpus_in_pci_bus_order_not_nvml_order(monkeypatch, visible, expected):
    """NVML's numbering is not promised to follow the PCI bus; CUDA's is, under CUDA_DEVICE_ORDER=PCI_BUS_ID."""
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    nvml = FakeNVML(["g0", "g1"], buses=["00000000:86:00.0", "00000000:3B:00.0"])
    assert devices.visible_gpu_names(nvml) == expected


@pytest.mark.parametrize(
    "visible, expected",
    [
        ("GPU-2c5e1d3a-47b6-2a19-9e0f-8d7c6b5a4e3f", ["g2"]),
        ("GPU-2c5e,GPU-0c", ["g2", "g0"]),  # enough of the start to name one GPU, as CUDA accepts
        ("GPU-1c5e,GPU-c,GPU-0c", ["g1"]),  # a prefix of none ends the list
        ("GPU-1c5e,GPU-,GPU-0c", ["g1"]),  # a prefix of several too
        ("GPU-0c5e,-1,1", ["g0"]),
    ],
)
def test_cuda_visible_device_uuids_are_matched_to_nvml_uuids(monkeypatch, visible, expected):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert devices.visible_gpu_names(FakeNVML(["g0", "g1", "g2"])) == expected


def test_numbers_in_cudas_default_fastest_first_order_are_refused_for_different_gpus(monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_ORDER")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert devices.visible_gpu_names(FakeNVML(["H100", "H100"])) == ["H100"]  # one model: they tie, by PCI bus
    mixed = FakeNVML(["NVIDIA RTX A4000", "NVIDIA H100"])
    with pytest.raises(InputError, match=r"CUDA_DEVICE_ORDER=FASTEST_FIRST .*set CUDA_DEVICE_ORDER=PCI_BUS_ID.*UUID"):
        devices.visible_gpu_names(mixed)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1c")  # UUIDs need no numbering
    assert devices.visible_gpu_names(mixed) == ["NVIDIA H100"]


def a100_in_mig_mode():
    """GPU 0 split into two MIG slices, GPU 1 whole."""
    slices = [("NVIDIA A100-SXM4-80GB MIG 3g.40gb", 39.5, 39.2), ("NVIDIA A100-SXM4-80GB MIG 1g.10gb", 9.8, 9.6)]
    return FakeNVML(["NVIDIA A100-SXM4-80GB"] * 2, memory_gib=80.0, capability=(8, 0), mig={0: slices})


def test_a_gpu_in_mig_mode_is_its_slices_with_their_own_memory_and_uuids(monkeypatch):
    found = devices.gpus(a100_in_mig_mode())
    assert [(gpu.name, gpu.memory_gib, gpu.uuid[:6]) for gpu in found] == [
        ("NVIDIA A100-SXM4-80GB MIG 3g.40gb", pytest.approx(39.5), "MIG-00"),
        ("NVIDIA A100-SXM4-80GB MIG 1g.10gb", pytest.approx(9.8), "MIG-01"),
        ("NVIDIA A100-SXM4-80GB", pytest.approx(80.0), "GPU-1c"),
    ]
    assert found[1].free_gib == pytest.approx(9.6) and found[1].compute_capability == (8, 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-017e2b9c")
    monkeypatch.setattr(devices, "_nvml", lambda nvml: a100_in_mig_mode())
    hardware = devices.resolve(None)
    assert hardware.names == ("NVIDIA A100-SXM4-80GB MIG 1g.10gb",)
    assert (hardware.memory_gib, hardware.free_gib) == (pytest.approx(9.8), pytest.approx(9.6))
    assert hardware.uuids == ("MIG-017e2b9c-0000-5d4e-a1b2-c3d4e5f60718",)


@pytest.mark.parametrize("call", ["handle", "name", "memory"])
def test_a_gpu_that_nvml_may_not_read_is_left_out_as_cuda_leaves_it_out(monkeypatch, call):
    """A cluster's cgroup hides GPU 0 from this job: NVML still counts it but refuses it (NO_PERMISSION)."""
    nvml = FakeNVML(["g0", "g1", "g2"], denied={(0, call)})
    assert devices.gpu_names(nvml) == ["g1", "g2"] and nvml.shut_down
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert devices.visible_gpu_names(nvml) == ["g1"]  # CUDA numbers the GPUs it can use


def test_resolve_falls_back_to_simulated_devices_when_nvml_may_read_no_gpu(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = FakeNVML(["g0", "g1"], denied={(0, "handle"), (1, "memory")})
    monkeypatch.setattr(devices, "_nvml", lambda _: nvml)
    assert devices.resolve(None, cores=4).kind == "cpu"

    def no_count():
        raise NoPermission("Insufficient Permissions")

    nvml.nvmlDeviceGetCount = no_count
    assert devices.gpus(nvml) == [] and nvml.shut_down


def test_resolve_keeps_the_smallest_free_memory_and_the_uuids_of_the_gpus_it_uses(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(devices, "_nvml", lambda _: FakeNVML(["H100"] * 3, memory_gib=80.0, free_gib=61.5))
    hardware = devices.resolve(2)
    assert (hardware.memory_gib, hardware.free_gib) == (pytest.approx(80.0), pytest.approx(61.5))
    assert hardware.uuids == (uuid(0), uuid(1))
    given = devices.resolve(2, gpus=["g0", "g1"], memory_gib=40.0)  # overrides: free as all of it unless given
    assert (given.free_gib, given.uuids) == (40.0, ())
    assert devices.resolve(1, gpus=["g0"], memory_gib=40.0, free_gib=12.0).free_gib == 12.0
    assert devices.resolve(None, gpus=[], cores=2).free_gib is None


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
