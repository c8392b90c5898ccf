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
        names = []
        for index in range(nvml.nvmlDeviceGetCount()):
            name = nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(index))
            names.append(name.decode() if isinstance(name, bytes) else name)
        return names
    finally:
        nvml.nvmlShutdown()


def visible_gpu_names(nvml=None) -> list[str]:
    """GPU names as CUDA sees them through ``CUDA_VISIBLE_DEVICES``.

    Like CUDA, the list is read up to its first invalid entry: ``-1`` (or an
    out-of-range index) hides every GPU after it. UUIDs are trusted by count.
    """
    names = gpu_names(nvml)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not names:
        return names
    picked = []
    for item in (part.strip() for part in visible.split(",")):
        if item.startswith(("GPU-", "MIG-")):
            if len(picked) < len(names):
                picked.append(names[len(picked)])
            continue
        if not item.isdigit() or int(item) >= len(names):
            break
        picked.append(names[int(item)])
    return picked


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity API
        return os.cpu_count() or 1


def threads_per_device(count: int, cores: int | None = None) -> int:
    """Simulated devices share the cores: each gets its own slice, never fewer than one."""
    return max(1, (cores or cpu_cores()) // max(1, count))


def loader_workers(devices: int, device_kind: str) -> int:
    """Decode processes per training process: one beside simulated CPU devices, which already share the cores."""
    if device_kind == "cpu":
        return 1
    return max(1, min(8, threads_per_device(devices) - 1))


def resolve(requested: int | None = None, *, gpus: list[str] | None = None, cores: int | None = None) -> Devices:
    """Resolve the ``DEVICES`` parameter; ``None`` means all GPUs (or 2 simulated CPU devices).

    ``gpus`` and ``cores`` override discovery (tests, or a forced CPU run).
    """
    if requested is not None and (isinstance(requested, bool) or not isinstance(requested, int) or requested < 1):
        raise InputError(f"DEVICES must be a positive integer or None (all devices), got {requested!r}.")
    gpus = visible_gpu_names() if gpus is None else gpus
    if gpus:
        count = len(gpus) if requested is None else requested
        if count > len(gpus):
            raise InputError(
                f"DEVICES={requested} but this machine has {len(gpus)} GPU(s) ({', '.join(gpus)}): "
                f"set DEVICES to at most {len(gpus)}, or None to use them all."
            )
        return Devices("gpu", count, len(gpus), tuple(gpus[:count]))
    cores = cores or cpu_cores()
    count = min(CPU_DEFAULT_DEVICES, cores) if requested is None else requested
    if count > cores:
        raise InputError(
            f"DEVICES={requested} but there is no GPU and only {cores} CPU core(s) to simulate devices on, "
            f"one core each at least: set DEVICES to at most {cores}, or run on a machine with GPUs."
        )
    return Devices("cpu", count, cores, tuple(f"cpu:{i}" for i in range(count)))
