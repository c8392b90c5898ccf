"""Shared defaults and the scaling rule, identical for every framework.

Defaults describe a full run on a GPU box. On a machine without a GPU,
:func:`defaults` shrinks them to a demo that finishes in minutes, so a laptop
in a workshop can run every notebook end to end.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from common.errors import InputError

FINDINGS = (
    "Atelectasis",
    "Cardiomegaly",
    "Effusion",
    "Infiltration",
    "Mass",
    "Nodule",
    "Pneumonia",
    "Pneumothorax",
    "Consolidation",
    "Edema",
    "Emphysema",
    "Fibrosis",
    "Pleural_Thickening",
    "Hernia",
)
NUM_CLASSES = len(FINDINGS)

# ImageNet statistics: grayscale X-rays are fed as three equal channels so
# that ImageNet-pretrained weights (PRETRAINED=True) see familiar inputs.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# RandomResizedCrop keeps at least this share of the image: a finding at the
# edge of the lung field should not be cropped away half of the time.
CROP_SCALE = (0.7, 1.0)

# DenseNet-121 downsamples by 32: smaller inputs vanish before the classifier.
MIN_IMAGE_SIZE = 32

# torchvision's BatchNorm keeps 90% of its running statistics per step (PyTorch's momentum=0.1, Keras' and
# Gluon's momentum=0.9, Chainer's decay=0.9); Keras' DenseNet keeps 99%, which after a short run still mostly
# remembers its initial values and evaluates badly. The same model in every framework means the same statistics.
BATCH_NORM_MOMENTUM = 0.9

# Before testing, every notebook re-estimates the BatchNorm statistics from this many training batches
# with the final weights ("precise BN"): in a short run at a high learning rate the running averages
# lag behind the weights, and evaluation with them varies from run to run far more than the model does.
BATCH_NORM_BATCHES = 16

# Adam at this rate per device; the global rate grows linearly with devices. In every notebook it is the
# peak of a cosine decay to 0 over the run: a short run at a high rate that ends at that rate ends wherever
# its last noisy steps left it, and 1 and 2 devices would then differ by chance.
BASE_LEARNING_RATE = 1e-4


@dataclass(frozen=True)
class Defaults:
    EPOCHS: int
    BATCH_SIZE_PER_DEVICE: int
    IMAGE_SIZE: int
    MAX_IMAGES: int | None
    BENCH_STEPS: int
    LEARNING_RATE_PER_DEVICE: float


GPU_DEFAULTS = Defaults(
    EPOCHS=5,
    BATCH_SIZE_PER_DEVICE=64,
    IMAGE_SIZE=224,
    MAX_IMAGES=None,
    BENCH_STEPS=50,
    LEARNING_RATE_PER_DEVICE=BASE_LEARNING_RATE,
)
CPU_DEFAULTS = Defaults(
    EPOCHS=3,
    BATCH_SIZE_PER_DEVICE=16,
    IMAGE_SIZE=64,
    MAX_IMAGES=800,
    BENCH_STEPS=10,
    # A short demo from scratch needs a larger step to learn in three epochs.
    LEARNING_RATE_PER_DEVICE=1e-3,
)


def defaults(device_kind: str) -> Defaults:
    """The defaults for ``"gpu"`` or ``"cpu"``."""
    if device_kind not in ("gpu", "cpu"):
        raise InputError(f"device kind must be 'gpu' or 'cpu', not {device_kind!r}")
    return GPU_DEFAULTS if device_kind == "gpu" else CPU_DEFAULTS


def fill(device_kind: str, **given) -> dict:
    """Replace each ``None`` among the notebook parameters by its default.

    Returns the resolved parameters (with the defaults that are not notebook
    parameters, such as the learning rate, included), refuses values that
    cannot train, and prints which defaults applied, so a CPU user sees that
    the run is a shrunken demo and not the benchmark.
    """
    base = asdict(defaults(device_kind))
    resolved = {**base, **{name: value for name, value in given.items() if value is not None or name not in base}}
    for name in ("EPOCHS", "BATCH_SIZE_PER_DEVICE", "IMAGE_SIZE", "BENCH_STEPS", "MAX_IMAGES"):
        check_positive_int(name, resolved.get(name), allow_none=name == "MAX_IMAGES")
    if resolved["IMAGE_SIZE"] < MIN_IMAGE_SIZE:
        raise InputError(
            f"IMAGE_SIZE={resolved['IMAGE_SIZE']} is too small: DenseNet-121 halves the image five times, "
            f"so set IMAGE_SIZE to {MIN_IMAGE_SIZE} or more."
        )
    filled = sorted(name for name, value in given.items() if value is None and base.get(name) is not None)
    if filled:
        note = " (a CPU demo: small images, a subset of the data)" if device_kind == "cpu" else ""
        print(f"Defaults for {device_kind}{note}: " + ", ".join(f"{n}={resolved[n]}" for n in filled))
    return resolved


def check_positive_int(name: str, value, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{name} must be a positive integer, got {value!r}: set {name} to 1 or more.")


def global_batch(batch_size_per_device: int, devices: int) -> int:
    """The scaling rule: every device keeps its batch, the global batch grows."""
    check_positive_int("BATCH_SIZE_PER_DEVICE", batch_size_per_device)
    check_positive_int("DEVICES", devices)
    return batch_size_per_device * devices


def per_device_batch(global_batch_size: int, devices: int) -> int:
    """Split a fixed global batch evenly (strong scaling); refuse uneven splits."""
    check_positive_int("global batch", global_batch_size)
    check_positive_int("DEVICES", devices)
    if global_batch_size % devices:
        raise InputError(
            f"The global batch of {global_batch_size} does not divide evenly over {devices} devices: "
            f"choose a global batch that is a multiple of {devices} "
            f"(for example {global_batch_size - global_batch_size % devices or devices})."
        )
    return global_batch_size // devices


def learning_rate(rate_per_device: float, devices: int) -> float:
    """Linear scaling: the global batch is ``devices`` times larger, so is the step."""
    if isinstance(rate_per_device, bool) or not isinstance(rate_per_device, int | float) or not rate_per_device > 0:
        raise InputError(f"LEARNING_RATE_PER_DEVICE must be positive, got {rate_per_device!r}.")
    check_positive_int("DEVICES", devices)
    return rate_per_device * devices


def check_precision(precision: str) -> str:
    if precision not in ("fp32", "mixed"):
        raise InputError(f"PRECISION must be 'fp32' or 'mixed', got {precision!r}.")
    return precision
