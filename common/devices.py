"""Which devices a run uses: real GPUs when NVML sees them, simulated CPU devices otherwise.

Every notebook calls :func:`resolve` once. Nothing here assumes CUDA exists:
the kind and count are discovered and reported.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from common.errors import InputError

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
    return [name for name, _ in gpus(nvml)]


def gpus(nvml=None) -> list[tuple[str, float]]:
    """``(name, total memory in GiB)`` of each NVIDIA GPU that NVML reports; empty without a driver or GPU."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
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
            found.append((name.decode() if isinstance(name, bytes) else name, memory))
        return found
    finally:
        nvml.nvmlShutdown()


def visible_gpu_names(nvml=None) -> list[str]:
    """GPU names as CUDA sees them through ``CUDA_VISIBLE_DEVICES``."""
    return [name for name, _ in visible_gpus(nvml)]


def visible_gpus(nvml=None) -> list[tuple[str, float]]:
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
) -> Devices:
    """Resolve the ``DEVICES`` parameter; ``None`` means all GPUs (or 2 simulated CPU devices).

    ``gpus`` (names), ``memory_gib`` (of each) and ``cores`` override discovery (tests, or a forced CPU run).
    """
    if requested is not None and (isinstance(requested, bool) or not isinstance(requested, int) or requested < 1):
        raise InputError(f"DEVICES must be a positive integer or None (all devices), got {requested!r}.")
    if gpus is None:
        found = visible_gpus()
        gpus, memory = [name for name, _ in found], [gib for _, gib in found]
    else:
        memory = [memory_gib] * len(gpus)
    if gpus:
        count = len(gpus) if requested is None else requested
        if count > len(gpus):
            raise InputError(
                f"DEVICES={requested} but this machine has {len(gpus)} GPU(s) ({', '.join(gpus)}): "
                f"set DEVICES to at most {len(gpus)}, or None to use them all."
            )
        smallest = min(memory[:count]) if None not in memory[:count] else None
        return Devices("gpu", count, len(gpus), tuple(gpus[:count]), smallest)
    cores = cores or cpu_cores()
    count = min(CPU_DEFAULT_DEVICES, cores) if requested is None else requested
    if count > cores:
        raise InputError(
            f"DEVICES={requested} but there is no GPU and only {cores} CPU core(s) to simulate devices on, "
            f"one core each at least: set DEVICES to at most {cores}, or run on a machine with GPUs."
        )
    return Devices("cpu", count, cores, tuple(f"cpu:{i}" for i in range(count)))
