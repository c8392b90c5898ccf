import pytest

from common import params
from common.errors import InputError


def test_global_batch_grows_with_devices():
    assert params.global_batch(64, 1) == 64
    assert params.global_batch(64, 4) == 256


def test_learning_rate_scales_linearly_with_devices():
    assert params.learning_rate(1e-4, 1) == pytest.approx(1e-4)
    assert params.learning_rate(1e-4, 8) == pytest.approx(8e-4)


@pytest.mark.parametrize("rate", [0, -1e-3, float("nan")])
def test_learning_rate_rejects_non_positive_rates(rate):
    with pytest.raises(InputError, match="LEARNING_RATE_PER_DEVICE must be positive"):
        params.learning_rate(rate, 2)


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
    assert cfg["LEARNING_RATE_PER_DEVICE"] == params.CPU_DEFAULTS.LEARNING_RATE_PER_DEVICE
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
    assert cfg["LEARNING_RATE_PER_DEVICE"] == params.BASE_LEARNING_RATE
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
