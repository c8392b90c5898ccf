import math
from pathlib import Path

import pytest

from common.errors import InputError
from common.run import devices, params


def test_global_batch_grows_with_devices():
    assert params.global_batch(64, 1) == 64
    assert params.global_batch(64, 4) == 256


def test_adams_learning_rate_scales_with_the_square_root_of_the_global_batch():
    cfg = {"LEARNING_RATE": 2e-4}
    assert params.learning_rate(cfg, params.REFERENCE_BATCH) == pytest.approx(2e-4)
    assert params.learning_rate(cfg, 4 * params.REFERENCE_BATCH) == pytest.approx(4e-4)  # four times the images
    assert params.learning_rate(cfg, 4 * params.REFERENCE_BATCH) == params.learning_rate(cfg, 256)


def test_eight_gpus_of_256_images_give_adam_a_rate_that_holds():
    """The issue's case: linear scaling gave Adam 3.2e-3 from the first step here; one GPU keeps its 4e-4."""
    cfg = params.fill("gpu")
    assert params.learning_rate(cfg, 256) == pytest.approx(4e-4)
    assert params.learning_rate(cfg, params.global_batch(256, 8)) == pytest.approx(1.131e-3, rel=1e-3)


def test_the_cpu_demo_keeps_its_rate_of_1e_3_for_one_device_of_16_images():
    cfg = params.fill("cpu")
    assert params.learning_rate(cfg, cfg["BATCH_SIZE_PER_DEVICE"]) == pytest.approx(1e-3)
    assert params.learning_rate(cfg, params.global_batch(cfg["BATCH_SIZE_PER_DEVICE"], 2)) == pytest.approx(
        1.414e-3, rel=1e-3
    )


def test_the_rate_climbs_from_zero_over_a_tenth_of_the_run_then_falls_along_a_cosine_to_zero():
    factors = [params.schedule_factor(step, 100) for step in range(101)]
    assert params.warmup_steps(100) == 10
    assert factors[:11] == pytest.approx([step / 10 for step in range(11)])  # the peak at the end of the warmup
    assert factors[10 + 45] == pytest.approx(0.5)  # half way down the cosine
    assert factors[100] == pytest.approx(0.0) and factors[99] == pytest.approx(0.5 * (1 + math.cos(math.pi * 89 / 90)))
    assert all(a >= b for a, b in zip(factors[10:], factors[11:]))  # after the warmup, only down
    # the mean rate of the run is half the peak, as without the warmup: the warmup moves steps, it does not slow the run
    assert sum(params.schedule_factor(step, 1000) for step in range(1000)) / 1000 == pytest.approx(0.5, abs=1e-3)


@pytest.mark.parametrize("steps", [1, 2, 4, 5])
def test_a_run_of_five_steps_or_fewer_has_no_warmup(steps):
    assert params.warmup_steps(steps) == 0
    assert params.schedule_factor(0, steps) == 1.0
    assert params.warmup_steps(6) == 1


@pytest.mark.parametrize("rate", [0, -1e-3, float("nan")])
def test_learning_rate_rejects_non_positive_rates(rate):
    with pytest.raises(InputError, match="LEARNING_RATE must be positive"):
        params.learning_rate({"LEARNING_RATE": rate}, 2)


@pytest.mark.parametrize(
    ("memory_gib", "precision", "image_size", "batch"),
    [
        (141.0, "mixed", 224, 256),  # an H200: 256, enough for 0.93 of batch 512's speed
        (40.0, "mixed", 224, 256),  # an A100 40GB
        (40.0, "fp32", 224, 128),  # fp32 needs twice the memory per image
        (24.0, "mixed", 224, 128),
        (16.0, "fp32", 224, 64),
        (16.0, "mixed", 448, 16),  # four times the pixels
        (2.0, "fp32", 224, 16),  # never below the smallest choice
    ],
)
def test_gpu_batch_follows_the_device_memory(memory_gib, precision, image_size, batch):
    assert params.gpu_batch_size(memory_gib, precision, image_size) == batch


def test_fill_chooses_the_gpu_batch_from_its_memory_unless_given(capsys):
    h100, small = (devices.resolve(1, gpus=["GPU"], memory_gib=gib) for gib in (80.0, 12.0))
    big = params.fill(h100, BATCH_SIZE_PER_DEVICE=None, PRECISION="mixed")
    assert big["BATCH_SIZE_PER_DEVICE"] == 256 and "BATCH_SIZE_PER_DEVICE=256" in capsys.readouterr().out
    assert params.fill(small, BATCH_SIZE_PER_DEVICE=None, PRECISION="fp32")["BATCH_SIZE_PER_DEVICE"] == 32
    assert params.fill(h100, BATCH_SIZE_PER_DEVICE=32)["BATCH_SIZE_PER_DEVICE"] == 32  # given: kept
    assert params.fill("gpu")["BATCH_SIZE_PER_DEVICE"] == params.GPU_DEFAULTS.BATCH_SIZE_PER_DEVICE  # memory unknown
    assert (
        params.fill(devices.resolve(2, gpus=[], cores=2))["BATCH_SIZE_PER_DEVICE"]
        == params.CPU_DEFAULTS.BATCH_SIZE_PER_DEVICE
    )


def test_fill_sizes_the_gpu_batch_from_the_free_memory_not_the_total():
    """Another process holds 68 of an H100's 80 GiB: a batch for 80 would not fit the 12 left."""
    busy = devices.resolve(1, gpus=["NVIDIA H100 80GB HBM3"], memory_gib=80.0, free_gib=12.0)
    assert params.fill(busy, BATCH_SIZE_PER_DEVICE=None, PRECISION="fp32")["BATCH_SIZE_PER_DEVICE"] == 32
    unknown = devices.Devices("gpu", 1, 1, ("GPU",), memory_gib=12.0)  # free memory unknown: the total
    assert params.fill(unknown, BATCH_SIZE_PER_DEVICE=None, PRECISION="fp32")["BATCH_SIZE_PER_DEVICE"] == 32


def test_fill_refuses_an_unknown_precision_and_records_the_one_given():
    assert params.fill("cpu", PRECISION="mixed")["PRECISION"] == "mixed"
    assert params.fill("cpu")["PRECISION"] == "fp32"
    with pytest.raises(InputError, match="PRECISION must be 'fp32' or 'mixed'"):
        params.fill("cpu", PRECISION="fp8")


def test_per_device_batch_splits_evenly():
    assert params.per_device_batch(256, 4) == 64


def test_per_device_batch_names_both_numbers_and_a_fix_when_uneven():
    with pytest.raises(InputError, match=r"global batch of 10 does not divide evenly over 4 devices") as caught:
        params.per_device_batch(10, 4)
    assert "multiple of 4" in str(caught.value)
    assert "for example 8" in str(caught.value)


@pytest.mark.parametrize("value", [0, -1, True, 2.5, "2", None])
def test_check_positive_int_rejects(value):
    with pytest.raises(InputError, match=r"EPOCHS must be a positive integer.*set EPOCHS to 1 or more"):
        params.check_positive_int("EPOCHS", value)


def test_check_positive_int_accepts_positive_ints_and_none_when_allowed():
    params.check_positive_int("EPOCHS", 1)
    params.check_positive_int("EPOCHS", 10**6)
    params.check_positive_int("MAX_IMAGES", None, allow_none=True)


@pytest.mark.parametrize("value", [0, -4])
def test_global_batch_rejects_bad_device_counts(value):
    with pytest.raises(InputError, match="DEVICES must be a positive integer"):
        params.global_batch(64, value)


def test_check_precision():
    assert params.check_precision("fp32") == "fp32"
    assert params.check_precision("mixed") == "mixed"
    for bad in ("fp16", "FP32", "", None):
        with pytest.raises(InputError, match=r"PRECISION must be 'fp32' or 'mixed'"):
            params.check_precision(bad)


def test_defaults_reject_unknown_device_kind():
    with pytest.raises(InputError, match="device kind must be 'gpu' or 'cpu'"):
        params.defaults("tpu")


def test_fill_replaces_none_with_cpu_defaults_and_keeps_given_values():
    cfg = params.fill("cpu", EPOCHS=None, BATCH_SIZE_PER_DEVICE=8, IMAGE_SIZE=None, MAX_IMAGES=None, DEVICES=None)
    assert cfg["EPOCHS"] == params.CPU_DEFAULTS.EPOCHS
    assert cfg["IMAGE_SIZE"] == params.CPU_DEFAULTS.IMAGE_SIZE
    assert cfg["MAX_IMAGES"] == params.CPU_DEFAULTS.MAX_IMAGES
    assert cfg["BATCH_SIZE_PER_DEVICE"] == 8  # given: kept
    assert cfg["DEVICES"] is None  # not a default: passed through
    assert cfg["LEARNING_RATE"] == params.CPU_DEFAULTS.LEARNING_RATE
    assert cfg["BENCH_STEPS"] == params.CPU_DEFAULTS.BENCH_STEPS


def test_fill_on_cpu_prints_that_it_is_a_demo_and_which_defaults_applied(capsys):
    params.fill("cpu", EPOCHS=None, BATCH_SIZE_PER_DEVICE=8, IMAGE_SIZE=None)
    out = capsys.readouterr().out
    assert "CPU demo" in out
    assert f"EPOCHS={params.CPU_DEFAULTS.EPOCHS}" in out
    assert f"IMAGE_SIZE={params.CPU_DEFAULTS.IMAGE_SIZE}" in out
    assert "BATCH_SIZE_PER_DEVICE" not in out  # given, so not a default


def test_fill_uses_gpu_defaults_without_the_demo_note(capsys):
    cfg = params.fill("gpu", EPOCHS=None, BATCH_SIZE_PER_DEVICE=None, IMAGE_SIZE=None, MAX_IMAGES=None)
    assert cfg["EPOCHS"] == params.GPU_DEFAULTS.EPOCHS
    assert cfg["BATCH_SIZE_PER_DEVICE"] == params.GPU_DEFAULTS.BATCH_SIZE_PER_DEVICE
    assert cfg["IMAGE_SIZE"] == params.GPU_DEFAULTS.IMAGE_SIZE
    assert cfg["MAX_IMAGES"] is None  # the full data set
    assert cfg["LEARNING_RATE"] == params.BASE_LEARNING_RATE
    out = capsys.readouterr().out
    assert "Defaults for gpu" in out
    assert "CPU demo" not in out


def test_fill_prints_nothing_when_every_value_is_given(capsys):
    cfg = params.fill("cpu", EPOCHS=1, BATCH_SIZE_PER_DEVICE=2, IMAGE_SIZE=32, MAX_IMAGES=100)
    assert (cfg["EPOCHS"], cfg["BATCH_SIZE_PER_DEVICE"], cfg["IMAGE_SIZE"], cfg["MAX_IMAGES"]) == (1, 2, 32, 100)
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("name", ["EPOCHS", "BATCH_SIZE_PER_DEVICE", "IMAGE_SIZE", "BENCH_STEPS", "MAX_IMAGES"])
def test_fill_refuses_values_that_cannot_train(name):
    with pytest.raises(InputError, match=rf"{name} must be a positive integer, got 0: set {name} to 1 or more"):
        params.fill("cpu", **{name: 0})


def test_fill_refuses_images_too_small_for_densenet():
    with pytest.raises(InputError, match="IMAGE_SIZE=16 is too small.*set IMAGE_SIZE to 32 or more"):
        params.fill("cpu", IMAGE_SIZE=16)


def test_fill_keeps_all_images_on_gpu():
    assert params.fill("gpu", MAX_IMAGES=None)["MAX_IMAGES"] is None


def test_a_training_split_smaller_than_one_global_batch_is_refused_with_the_numbers_and_the_fixes():
    """check.sh once ran 840 training images at 4 GPUs x 256: every framework took no step and then crashed."""
    assert params.check_steps(840, 256, 1) == 3
    with pytest.raises(InputError, match=r"holds 840 images, fewer than one global batch of 1024 \(256 per device x 4"):
        params.check_steps(840, 1024, 4)
    with pytest.raises(InputError, match="BATCH_SIZE_PER_DEVICE to 105 or less"):
        params.check_steps(840, 1024, 4)


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_the_gpu_check_sizes_its_data_so_that_every_gpu_count_takes_several_steps(gpus):
    """tests/gpu/check.sh generates params.images_for_steps(4, 64 x GPUs) images (at least 1,200)."""
    images = max(1200, params.images_for_steps(4, 64 * gpus))
    train = int(images * params.TRAIN_SHARE * 0.97)  # a patient split may fall a little short of its share
    assert params.check_steps(train, 64 * gpus, gpus) >= 4
    assert "images_for_steps(4, $batch * $gpus)" in (Path(__file__).parent / "gpu" / "check.sh").read_text()


def test_choices_and_pretrained_weights_are_refused_with_the_reason_and_the_fix():
    assert params.check_choice("STRATEGY", "b", ("a", "b")) == "b"
    with pytest.raises(InputError, match="STRATEGY must be one of 'a', 'b', got 'c'"):
        params.check_choice("STRATEGY", "c", ("a", "b"))
    params.check_not_pretrained(False, "no weights")
    with pytest.raises(InputError, match="PRETRAINED=True: no weights; set PRETRAINED=False"):
        params.check_not_pretrained(True, "no weights")
