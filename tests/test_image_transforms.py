"""The Pillow and numpy image pipeline of the Gluon and Chainer notebooks."""

import numpy as np
import pytest

from common.data import chestxray, image_transforms
from common.errors import InputError
from common.run.params import CROP_SCALE, IMAGENET_MEAN, IMAGENET_STD


def test_crop_box_keeps_the_area_share_the_aspect_ratio_and_the_image():
    rng = np.random.default_rng(0)
    for _ in range(200):
        left, top, right, bottom = image_transforms.random_crop_box(100, 80, rng)
        assert 0 <= left < right <= 100 and 0 <= top < bottom <= 80
        area = (right - left) * (bottom - top) / 8000
        assert CROP_SCALE[0] - 0.03 <= area <= CROP_SCALE[1], area  # rounding to whole pixels
        assert 3 / 4 - 0.05 <= (right - left) / (bottom - top) <= 4 / 3 + 0.05


def test_training_images_depend_on_seed_epoch_and_image_only(standin):
    pixels = chestxray.load(standin, seed=0)["train"].pixels(0)
    first = image_transforms.transform(pixels, 32, augment=(0, 1, 7))
    np.testing.assert_array_equal(first, image_transforms.transform(pixels, 32, augment=(0, 1, 7)))
    assert not np.array_equal(first, image_transforms.transform(pixels, 32, augment=(0, 2, 7))), (
        "another epoch, another crop"
    )
    assert first.shape == (3, 32, 32) and first.dtype == np.float32


def test_evaluation_images_are_three_equal_normalized_channels(standin):
    image = image_transforms.transform(chestxray.load(standin, seed=0)["test"].pixels(0), 48)
    assert image.shape == (3, 48, 48) and image.dtype == np.float32
    pixels = image * np.array(IMAGENET_STD)[:, None, None] + np.array(IMAGENET_MEAN)[:, None, None]
    np.testing.assert_allclose(pixels[0], pixels[1], atol=1e-6)
    assert 0 <= pixels.min() and pixels.max() <= 1 + 1e-6


def test_unreadable_image_is_named(tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png")
    with pytest.raises(InputError, match="broken.png"):
        chestxray.Split([str(broken)], np.zeros((1, 14)), np.zeros(1)).pixels(0)
