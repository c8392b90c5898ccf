"""Which devices a run uses: real GPUs when NVML sees them, simulated CPU devices otherwise.

Every notebook calls :func:`resolve` once. Nothing here assumes CUDA exists:
the kind and count are discovered and reported.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from common.errors import InputError
from common.run.environments import MIN_DRIVER

# Without a GPU, a data-parallel demo on a laptop uses two simulated devices
# unless asked otherwise: enough to show gradient averaging, cheap enough to run.
CPU_DEFAULT_DEVICES = 2


@dataclass(frozen=True)
class Devices:
    kind: str  # "gpu" or "cpu"
    count: int  # how many this run uses
    available: int  # how many exist (for "cpu": one per core)
    names: tuple[str, ...]  # one per used device
    memory_gib: float | None = None  # the smallest total memory of the used GPUs; None for simulated devices
    compute_capability: tuple[int, int] | None = None  # the oldest of the used GPUs; None for simulated devices

    @property
    def simulated(self) -> bool:
        return self.kind == "cpu"

    def describe(self) -> str:
        if self.simulated:
            return (
                f"{self.count} simulated CPU device(s) sharing {self.available} cores "
                f"({threads_per_device(self.count, self.available)} thread(s) each)"
            )
        return f"{self.count} of {self.available} GPU(s): " + ", ".join(self.names)


def gpu_names(nvml=None) -> list[str]:
    """Names of the NVIDIA GPUs that NVML reports; empty without a driver or GPU."""
    return [gpu.name for gpu in gpus(nvml)]


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float
    compute_capability: tuple[int, int] | None = None


def _nvml(nvml):
    if nvml is not None:
        return nvml
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def gpus(nvml=None) -> list[GPU]:
    """Every NVIDIA GPU that NVML reports; empty without a driver or GPU."""
    nvml = _nvml(nvml)
    if nvml is None:
        return []
    try:
        nvml.nvmlInit()
    except Exception:  # no driver or no GPU: NVML raises its own NVMLError types
        return []
    try:
        found = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            name = nvml.nvmlDeviceGetName(handle)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle).total / 2**30
            try:
                capability = tuple(nvml.nvmlDeviceGetCudaComputeCapability(handle))
            except Exception:  # an old driver's NVML: unknown
                capability = None
            found.append(GPU(name.decode() if isinstance(name, bytes) else name, memory, capability))
        return found
    finally:
        nvml.nvmlShutdown()


def driver_version(nvml=None) -> str | None:
    """The NVIDIA driver's version as NVML reports it; None without a driver."""
    nvml = _nvml(nvml)
    if nvml is None:
        return None
    try:
        nvml.nvmlInit()
    except Exception:
        return None
    try:
        version = nvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else version
    finally:
        nvml.nvmlShutdown()


def visible_gpu_names(nvml=None) -> list[str]:
    """GPU names as CUDA sees them through ``CUDA_VISIBLE_DEVICES``."""
    return [gpu.name for gpu in visible_gpus(nvml)]


def visible_gpus(nvml=None) -> list[GPU]:
    """:func:`gpus` as CUDA sees them through ``CUDA_VISIBLE_DEVICES``.

    Like CUDA, the list is read up to its first invalid entry: ``-1`` (or an
    out-of-range index) hides every GPU after it. UUIDs are trusted by count.
    """
    found = gpus(nvml)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not found:
        return found
    picked = []
    for item in (part.strip() for part in visible.split(",")):
        if item.startswith(("GPU-", "MIG-")):
            if len(picked) < len(found):
                picked.append(found[len(picked)])
            continue
        if not item.isdigit() or int(item) >= len(found):
            break
        picked.append(found[int(item)])
    return picked


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity API
        return os.cpu_count() or 1


def threads_per_device(count: int, cores: int | None = None) -> int:
    """Simulated devices share the cores: each gets its own slice, never fewer than one."""
    return max(1, (cores or cpu_cores()) // max(1, count))


def loader_workers(device_kind: str, devices: int, processes: int | None = None) -> int:
    """Decode processes (or threads) per training process, the one rule of every framework.

    Simulated CPU devices already share the cores: one each. On GPUs the cores are shared among the ``processes``
    that train (one per device unless one process drives them all, as Gluon's does), each keeping a core for its
    own work, and at most 8 per device it drives: beyond that a GPU waits for nothing more.
    """
    if device_kind == "cpu":
        return 1
    processes = devices if processes is None else processes
    return max(1, min(8 * max(1, devices // processes), cpu_cores() // processes - 1))


def resolve(
    requested: int | None = None,
    *,
    gpus: list[str] | None = None,
    cores: int | None = None,
    memory_gib: float | None = None,
    compute_capability: tuple[int, int] | None = None,
) -> Devices:
    """Resolve the ``DEVICES`` parameter; ``None`` means all GPUs (or 2 simulated CPU devices).

    ``gpus`` (names), ``memory_gib`` and ``compute_capability`` (of each) and ``cores`` override discovery (tests, or
    a forced CPU run).
    """
    if requested is not None and (isinstance(requested, bool) or not isinstance(requested, int) or requested < 1):
        raise InputError(f"DEVICES must be a positive integer or None (all devices), got {requested!r}.")
    if gpus is None:
        found = visible_gpus()
    else:
        found = [GPU(name, memory_gib, compute_capability) for name in gpus]
    if found:
        names = [gpu.name for gpu in found]
        count = len(found) if requested is None else requested
        if count > len(found):
            raise InputError(
                f"DEVICES={requested} but this machine has {len(found)} GPU(s) ({', '.join(names)}): "
                f"set DEVICES to at most {len(found)}, or None to use them all."
            )
        used = found[:count]
        memory = [gpu.memory_gib for gpu in used]
        capabilities = [gpu.compute_capability for gpu in used]
        smallest = min(memory) if None not in memory else None
        oldest = min(capabilities) if None not in capabilities else None
        return Devices("gpu", count, len(found), tuple(names[:count]), smallest, oldest)
    cores = cores or cpu_cores()
    count = min(CPU_DEFAULT_DEVICES, cores) if requested is None else requested
    if count > cores:
        raise InputError(
            f"DEVICES={requested} but there is no GPU and only {cores} CPU core(s) to simulate devices on, "
            f"one core each at least: set DEVICES to at most {cores}, or run on a machine with GPUs."
        )
    return Devices("cpu", count, cores, tuple(f"cpu:{i}" for i in range(count)))


def require_usable(hardware: Devices, framework: str, usable: int, cuda_build: str | None, why: str = "") -> None:
    """Stop before any training when NVML lists GPUs that ``framework`` cannot use: a CUDA build newer than the
    driver, or a build without CUDA. Falling back to the CPU would train for hours with a GPU's defaults.

    ``usable`` is how many GPUs the framework itself sees; ``cuda_build`` the CUDA version it was built for (None:
    none); ``why`` what the framework said when it tried.
    """
    if hardware.kind != "gpu" or usable >= hardware.count:
        return
    driver = driver_version() or "unknown"
    if cuda_build:
        needed = MIN_DRIVER.get(int(cuda_build.split(".")[0]))
        build = f"built for CUDA {cuda_build}" + (f", which needs NVIDIA driver {needed} or newer" if needed else "")
    else:
        build = "a build without CUDA"
    raise InputError(
        f"NVML lists {hardware.available} GPU(s) ({', '.join(hardware.names)}; NVIDIA driver {driver}), but "
        f"{framework} ({build}) can use {usable} of the {hardware.count} asked for{f' ({why})' if why else ''}. "
        "Run `make setup` on this machine "
        "again: it installs the builds this driver runs (GPU=1 forces the CUDA builds), or update the NVIDIA driver. "
        "To train on simulated CPU devices instead, hide the GPUs: start the kernel with CUDA_VISIBLE_DEVICES= "
        "(empty)."
    )
