"""Shared defaults and the scaling rule, identical for every framework.

Defaults describe a full run on a GPU box. On a machine without a GPU,
:func:`defaults` shrinks them to a demo that finishes in minutes, so a laptop
in a workshop can run every notebook end to end.
"""

from __future__ import annotations

import math
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

# The patient split's shares of the images (common.data.chestxray.assign_splits); training gets the rest.
VALID_SHARE, TEST_SHARE = 0.1, 0.2
TRAIN_SHARE = 1 - VALID_SHARE - TEST_SHARE

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

# Adam's rate for a global batch of REFERENCE_BATCH images, scaled to the run's global batch by the square root of
# the ratio (learning_rate). Linear scaling, the rule of the 2018 benchmark, is Goyal et al.'s rule of thumb for SGD
# (2017, "Accurate, Large Minibatch SGD"), and it held there only with a warmup and up to about 8k images; for Adam the
# square root keeps the noise of the updates the same (Malladi et al. 2022, "On the SDEs and Scaling Rules for Adaptive
# Gradient Algorithms"). Neither rule is a law: past some batch size no rate recovers the small batch's accuracy per
# epoch. On 8 GPUs of 256 images the linear rule gave Adam 3.2e-3 (from 1e-4 per 64 images) from the first step; the
# square root gives 1.1e-3 (from 2e-4 per 64) after a warmup, and one GPU keeps the 4e-4 it had.
REFERENCE_BATCH = 64
BASE_LEARNING_RATE = 2e-4  # 4e-4 for one GPU's default batch of 256

# The rate climbs linearly from 0 over the first WARMUP_SHARE of the steps, then falls along a cosine to 0 at the end
# (schedule_factor), in every notebook. The warmup keeps Adam's first steps, taken before its moment estimates mean
# anything, from throwing a freshly initialized network far off (Goyal et al. warmed up over 5 of 90 epochs; these runs
# are a few epochs long). The cosine ends the run at a small rate: a short run that ended at its peak would end
# wherever its last noisy steps left it, and 1 and 2 devices would then differ by chance.
WARMUP_SHARE = 0.1

# Per-device batches a GPU default chooses from, largest first: the largest whose estimated training memory
# (ESTIMATED_GIB_PER_IMAGE at 224 px, from DenseNet-121's measured peak on an H200: 8.0 GiB at batch 64 in
# fp32, 16.1 GiB at batch 256 with bf16 autocast) fills at most half the smallest GPU's memory, leaving room for
# a framework's own overhead. The H200 steps at about 1,070 images/s at batch 64 and 2,860 at batch 256 (bf16):
# a batch too small for the device leaves most of it idle. 256 is enough to reach 0.93 of batch 512's speed.
GPU_BATCHES = (256, 128, 64, 32, 16)
ESTIMATED_GIB_PER_IMAGE = {"fp32": 0.125, "mixed": 0.063}


@dataclass(frozen=True)
class Defaults:
    EPOCHS: int
    BATCH_SIZE_PER_DEVICE: int
    IMAGE_SIZE: int
    MAX_IMAGES: int | None
    BENCH_STEPS: int
    LEARNING_RATE: float  # for a global batch of REFERENCE_BATCH images


GPU_DEFAULTS = Defaults(
    EPOCHS=5,
    BATCH_SIZE_PER_DEVICE=64,  # without a known memory size; see gpu_batch_size
    IMAGE_SIZE=224,
    MAX_IMAGES=None,
    BENCH_STEPS=50,
    LEARNING_RATE=BASE_LEARNING_RATE,
)
CPU_DEFAULTS = Defaults(
    EPOCHS=3,
    BATCH_SIZE_PER_DEVICE=16,
    IMAGE_SIZE=64,
    MAX_IMAGES=800,
    BENCH_STEPS=10,
    # A short demo from scratch needs a larger step to learn in three epochs: 1e-3 for one device's 16 images.
    LEARNING_RATE=2e-3,
)


def defaults(device_kind: str) -> Defaults:
    """The defaults for ``"gpu"`` or ``"cpu"``."""
    if device_kind not in ("gpu", "cpu"):
        raise InputError(f"device kind must be 'gpu' or 'cpu', not {device_kind!r}")
    return GPU_DEFAULTS if device_kind == "gpu" else CPU_DEFAULTS


def prepared_size(image_size: int) -> int:
    """The side the data set is prepared at for training at ``image_size`` (:mod:`common.data.prepare`): 8/7 of it, as
    256 is for 224, so the random crops still have pixels to choose from."""
    return round(image_size * 8 / 7)


def gpu_batch_size(memory_gib: float, precision: str = "fp32", image_size: int = 224) -> int:
    """The largest of ``GPU_BATCHES`` whose estimated training memory fills at most half of ``memory_gib``."""
    per_image = ESTIMATED_GIB_PER_IMAGE[precision] * (image_size / 224) ** 2
    return next((batch for batch in GPU_BATCHES if batch * per_image <= memory_gib / 2), GPU_BATCHES[-1])


def fill(hardware, **given) -> dict:
    """Replace each ``None`` among the notebook parameters by its default for ``hardware`` (a
    :class:`common.run.devices.Devices`, or just its kind, ``"gpu"`` or ``"cpu"``).

    Returns the resolved parameters (with the defaults that are not notebook
    parameters, such as the learning rate, included), refuses values that
    cannot train (``PRECISION`` among them), and prints which defaults applied,
    so a CPU user sees that the run is a shrunken demo and not the benchmark.
    On GPUs whose memory is known, the default per-device batch is the one that fits the smallest free memory among
    them (:func:`gpu_batch_size`): what the kernel or another process holds is not there for training.
    """
    device_kind = getattr(hardware, "kind", hardware)
    # what the batch may fill is the memory left free (by the driver, other processes), not the total
    memory_gib = getattr(hardware, "free_gib", None) or getattr(hardware, "memory_gib", None)
    precision = check_precision(given.get("PRECISION", "fp32"))
    base = asdict(defaults(device_kind))
    if device_kind == "gpu" and memory_gib:
        size = given.get("IMAGE_SIZE") or base["IMAGE_SIZE"]
        base["BATCH_SIZE_PER_DEVICE"] = gpu_batch_size(memory_gib, precision, size)
    resolved = {**base, **{name: value for name, value in given.items() if value is not None or name not in base}}
    for name in ("EPOCHS", "BATCH_SIZE_PER_DEVICE", "IMAGE_SIZE", "BENCH_STEPS", "MAX_IMAGES"):
        check_positive_int(name, resolved.get(name), allow_none=name == "MAX_IMAGES")
    if resolved["IMAGE_SIZE"] < MIN_IMAGE_SIZE:
        raise InputError(
            f"IMAGE_SIZE={resolved['IMAGE_SIZE']} is too small: DenseNet-121 halves the image five times, "
            f"so set IMAGE_SIZE to {MIN_IMAGE_SIZE} or more."
        )
    resolved["PRECISION"] = precision
    # PREPARED (True unless given): train from the copy of the data set prepared once at PREPARED_SIZE; False decodes
    # and shrinks the PNGs to that size every epoch (common.data.chestxray.load)
    resolved["PREPARED"] = given.get("PREPARED", True) is not False
    resolved["PREPARED_SIZE"] = prepared_size(resolved["IMAGE_SIZE"])
    filled = sorted(name for name, value in given.items() if value is None and base.get(name) is not None)
    if filled:
        note = " (a CPU demo: small images, a subset of the data)" if device_kind == "cpu" else ""
        print(f"Defaults for {device_kind}{note}: " + ", ".join(f"{n}={resolved[n]}" for n in filled))
    return resolved


# The filled-in parameters that shape training: a checkpoint written with other values is another run.
SHAPING = ("EPOCHS", "BATCH_SIZE_PER_DEVICE", "IMAGE_SIZE", "MAX_IMAGES", "PRECISION", "PREPARED_SIZE")


def settings(cfg: dict, **given) -> dict:
    """The run's settings as checkpoints compare them: the notebook's own parameters ``given`` (DATA_DIR, DEVICES,
    SEED, a strategy ...) and the filled-in values of ``SHAPING``."""
    return {**given, **{name: cfg[name] for name in SHAPING}}


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


def check_steps(train_images: int, global_batch: int, devices: int) -> int:
    """The training steps of one epoch (the last partial batch is dropped in every framework); refuses a run whose
    training split holds less than one global batch, naming the numbers and the fixes. Called as soon as the split is
    made (:func:`common.data.chestxray.load`), before any training: :func:`fill` cannot know how many images a folder
    holds or how its patients split."""
    steps = train_images // global_batch
    if steps == 0:
        per_device = global_batch // devices
        raise InputError(
            f"The training split holds {train_images} images, fewer than one global batch of {global_batch} "
            f"({per_device} per device x {devices} device(s)): an epoch would take no step. Set BATCH_SIZE_PER_DEVICE "
            f"to {max(1, train_images // devices // 2)} or less (two steps or more), use fewer DEVICES, or raise "
            f"MAX_IMAGES to {images_for_steps(1, global_batch)} or more (the training split is about "
            f"{TRAIN_SHARE:.0%} of the images; None uses all of them)."
        )
    return steps


def images_for_steps(steps: int, global_batch: int) -> int:
    """The ``MAX_IMAGES`` (rounded up to hundreds) whose training split takes about ``steps`` steps of ``global_batch``
    per epoch; the split is by patient, so a margin of 5% keeps the count from falling just short."""
    return math.ceil(steps * global_batch / TRAIN_SHARE * 1.05 / 100) * 100


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


def learning_rate(cfg: dict, global_batch_size: int) -> float:
    """The peak rate of a run: ``cfg["LEARNING_RATE"]`` (for REFERENCE_BATCH images) scaled to ``global_batch_size``
    by :func:`scale_learning_rate`."""
    rate = cfg["LEARNING_RATE"]
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not rate > 0:
        raise InputError(f"LEARNING_RATE must be positive, got {rate!r}.")
    check_positive_int("global batch", global_batch_size)
    return scale_learning_rate(rate, global_batch_size / REFERENCE_BATCH)


def scale_learning_rate(rate: float, batch_ratio: float) -> float:
    """Adam's rate for a batch ``batch_ratio`` times larger: times its square root (see REFERENCE_BATCH)."""
    return rate * math.sqrt(batch_ratio)


def warmup_steps(steps: int) -> int:
    """The steps of the warmup in a run of ``steps``: WARMUP_SHARE of them, rounded half to even: none in a run of 5
    steps or fewer."""
    return round(WARMUP_SHARE * steps)


def schedule_factor(step: int, steps: int) -> float:
    """The share of the peak rate used by update ``step`` (from 0) of ``steps``: up from 0 in a straight line over the
    warmup, then down a half cosine to 0 (Keras' ``CosineDecay`` with ``warmup_target``, MXNet's ``CosineScheduler``
    with ``warmup_steps``, Hugging Face's ``get_cosine_schedule_with_warmup``)."""
    warmup = warmup_steps(steps)
    if step < warmup:
        return step / warmup
    return 0.5 * (1 + math.cos(math.pi * min(step - warmup, steps - warmup) / (steps - warmup)))


def check_choice(name: str, value, choices: tuple) -> str:
    """``value`` of the parameter ``name`` if it is one of ``choices``; else the error that lists them."""
    if value not in choices:
        raise InputError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}.")
    return value


def check_not_pretrained(pretrained: bool, why: str) -> None:
    """Refuse ``PRETRAINED=True`` for a model that has no ImageNet weights to start from, saying ``why`` not."""
    if pretrained:
        raise InputError(
            f"PRETRAINED=True: {why}; set PRETRAINED=False (PyTorch_MultiGPU and the TensorFlow notebooks can start "
            "from ImageNet weights)."
        )


def check_precision(precision: str) -> str:
    if precision not in ("fp32", "mixed"):
        raise InputError(f"PRECISION must be 'fp32' or 'mixed', got {precision!r}.")
    return precision
