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

# CUDA numbers the GPUs fastest first unless told otherwise, NVML by PCI bus: so that a number in
# CUDA_VISIBLE_DEVICES means the same GPU to both, CUDA is told to number them by PCI bus too. Set on import, before
# any framework starts CUDA (common.tensorflow.imports does on its import), and inherited by the training processes.
os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")

MIG_ENABLED = 1  # pynvml.NVML_DEVICE_MIG_ENABLE


@dataclass(frozen=True)
class Devices:
    kind: str  # "gpu" or "cpu"
    count: int  # how many this run uses
    available: int  # how many exist (for "cpu": one per core)
    names: tuple[str, ...]  # one per used device
    memory_gib: float | None = None  # the smallest total memory of the used GPUs; None for simulated devices
    compute_capability: tuple[int, int] | None = None  # the oldest of the used GPUs; None for simulated devices
    free_gib: float | None = None  # the smallest free memory of the used GPUs when resolved; None if unknown
    # NVML's UUIDs of the used GPUs (MIG-... for MIG slices), for the monitor; () if unknown
    uuids: tuple[str, ...] = ()

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
    free_gib: float | None = None
    uuid: str = ""  # as CUDA_VISIBLE_DEVICES names it: GPU-..., or MIG-... for a MIG slice


def _nvml(nvml):
    if nvml is not None:
        return nvml
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value  # older pynvml returns bytes


def gpus(nvml=None) -> list[GPU]:
    """Every GPU that NVML can read (:func:`nvml_devices`); empty without a driver or GPU."""
    nvml = _nvml(nvml)
    if nvml is None:
        return []
    try:
        nvml.nvmlInit()
    except Exception:  # no driver or no GPU: NVML raises its own NVMLError types
        return []
    try:
        return [gpu for gpu, _ in nvml_devices(nvml)]
    finally:
        nvml.nvmlShutdown()


def nvml_devices(nvml) -> list[tuple[GPU, object]]:
    """The devices CUDA can be given, each with its NVML handle (NVML initialized), in PCI bus order, which NVML's
    own numbering does not promise. A GPU in MIG mode is its MIG slices, which is what CUDA sees of it. A device
    whose handle or properties NVML refuses (NO_PERMISSION for a GPU that a cluster's cgroup hides) is left out:
    this process cannot use it either."""
    try:
        count = nvml.nvmlDeviceGetCount()
    except Exception:
        return []
    found = []
    for index in range(count):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            bus = _text(nvml.nvmlDeviceGetPciInfo(handle).busId)
        except Exception:
            continue
        try:
            capability = tuple(nvml.nvmlDeviceGetCudaComputeCapability(handle))
        except Exception:  # an old driver's NVML: unknown
            capability = None
        slices = _mig_slices(nvml, handle)
        for device in [handle] if slices is None else slices:
            try:
                memory = nvml.nvmlDeviceGetMemoryInfo(device)
                gpu = GPU(
                    _text(nvml.nvmlDeviceGetName(device)),
                    memory.total / 2**30,
                    capability,
                    memory.free / 2**30,
                    _text(nvml.nvmlDeviceGetUUID(device)),
                )
            except Exception:
                continue
            found.append((bus, gpu, device))
    return [(gpu, device) for _, gpu, device in sorted(found, key=lambda row: row[0])]  # stable: slices keep order


def _mig_slices(nvml, handle) -> list | None:
    """The MIG slices' handles of a GPU in MIG mode; None for a whole GPU, or where NVML cannot tell (no MIG)."""
    try:
        if nvml.nvmlDeviceGetMigMode(handle)[0] != MIG_ENABLED:
            return None
        count = nvml.nvmlDeviceGetMaxMigDeviceCount(handle)
    except Exception:
        return None
    slices = []
    for index in range(count):
        try:
            slices.append(nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index))
        except Exception:  # a slot without a slice
            pass
    return slices


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
        return _text(nvml.nvmlSystemGetDriverVersion())
    finally:
        nvml.nvmlShutdown()


def visible_gpu_names(nvml=None) -> list[str]:
    """GPU names as CUDA sees them through ``CUDA_VISIBLE_DEVICES``."""
    return [gpu.name for gpu in visible_gpus(nvml)]


def visible_gpus(nvml=None) -> list[GPU]:
    """:func:`gpus` as CUDA sees them through ``CUDA_VISIBLE_DEVICES``.

    A number counts the GPUs in CUDA's order (:func:`cuda_numbered`); a UUID (``GPU-...``, ``MIG-...``, or enough of
    its start to name one device) is matched to NVML's. Like CUDA, the list is read up to its first invalid entry:
    ``-1``, an out-of-range number or an unknown UUID hides every GPU after it.
    """
    found = gpus(nvml)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return cuda_numbered(found)
    picked = []
    for item in (part.strip() for part in visible.split(",")):
        if item.isdigit():
            matches = cuda_numbered(found)[int(item) : int(item) + 1]
        else:
            matches = [gpu for gpu in found if item.startswith(("GPU-", "MIG-")) and gpu.uuid.startswith(item)]
        if len(matches) != 1:
            break
        picked.append(matches[0])
    return picked


def cuda_numbered(found: list[GPU]) -> list[GPU]:
    """``found`` (in PCI bus order) in the order CUDA numbers them: the same under ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
    (set on import), and for GPUs of one model, which tie in CUDA's default fastest-first order. GPUs that differ
    are numbered by a speed rule of CUDA's own that NVML cannot reproduce: refused rather than guessed."""
    order = os.environ.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    if order == "PCI_BUS_ID" or len({gpu.name for gpu in found}) < 2:
        return found
    raise InputError(
        f"CUDA_DEVICE_ORDER={order} numbers these different GPUs ({', '.join(gpu.name for gpu in found)}) by "
        "CUDA's own speed rule, so which of them a run would use cannot be told: set CUDA_DEVICE_ORDER=PCI_BUS_ID "
        "(or leave it unset) before starting the kernel, or name the GPUs by UUID in CUDA_VISIBLE_DEVICES "
        "(`nvidia-smi -L` lists them)."
    )


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
    free_gib: float | None = None,
) -> Devices:
    """Resolve the ``DEVICES`` parameter; ``None`` means all GPUs (or 2 simulated CPU devices).

    ``gpus`` (names), ``memory_gib``, ``compute_capability`` and ``free_gib`` (of each; free: all of the memory unless
    given) and ``cores`` override discovery (tests, or a forced CPU run).
    """
    if requested is not None and (isinstance(requested, bool) or not isinstance(requested, int) or requested < 1):
        raise InputError(f"DEVICES must be a positive integer or None (all devices), got {requested!r}.")
    if gpus is None:
        found = visible_gpus()
    else:
        free = memory_gib if free_gib is None else free_gib
        found = [GPU(name, memory_gib, compute_capability, free) for name in gpus]
    if found:
        names = [gpu.name for gpu in found]
        count = len(found) if requested is None else requested
        if count > len(found):
            raise InputError(
                f"DEVICES={requested} but this machine has {len(found)} GPU(s) ({', '.join(names)}): "
                f"set DEVICES to at most {len(found)}, or None to use them all."
            )
        used = found[:count]
        uuids = tuple(gpu.uuid for gpu in used)
        return Devices(
            "gpu",
            count,
            len(found),
            tuple(names[:count]),
            _least(gpu.memory_gib for gpu in used),
            _least(gpu.compute_capability for gpu in used),
            _least(gpu.free_gib for gpu in used),
            uuids if all(uuids) else (),
        )
    cores = cores or cpu_cores()
    count = min(CPU_DEFAULT_DEVICES, cores) if requested is None else requested
    if count > cores:
        raise InputError(
            f"DEVICES={requested} but there is no GPU and only {cores} CPU core(s) to simulate devices on, "
            f"one core each at least: set DEVICES to at most {cores}, or run on a machine with GPUs."
        )
    return Devices("cpu", count, cores, tuple(f"cpu:{i}" for i in range(count)))


def _least(values):
    """The smallest of ``values``; None when one of them is unknown."""
    values = list(values)
    return None if None in values else min(values)


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
