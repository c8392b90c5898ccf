"""The Pillow and numpy image pipeline of the Gluon and Chainer notebooks."""

import numpy as np
import pytest
from PIL import Image, ImageOps

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
    assert first.shape == (1, 32, 32) and first.dtype == np.uint8, "one byte per pixel to the training process"


def normalized_on_the_host(pixels, image_size, augment=None):
    """The transform as it was when the host normalized: ImageNet-normalized float32 (3, size, size), the reference
    for the devices' normalization (``normalize`` of ``common.mxnet.utils`` and ``common.chainer.utils``)."""
    image = Image.fromarray(pixels)
    size = (image_size, image_size)
    if augment is None:
        image = ImageOps.fit(image, size, Image.BILINEAR)
    else:
        rng = np.random.default_rng(list(augment))
        image = image.resize(size, Image.BILINEAR, box=image_transforms.random_crop_box(*image.size, rng))
        if rng.random() < 0.5:
            image = ImageOps.mirror(image)
    mean, std = (np.array(values, np.float32)[:, None, None] for values in (IMAGENET_MEAN, IMAGENET_STD))
    return (np.asarray(image, np.float32)[None] / 255 - mean) / std


@pytest.mark.parametrize("augment", [None, (0, 1, 7), (3, 0, 2)])
def test_the_gray_bytes_are_the_pixels_the_host_normalized_before(standin, augment):
    """The same crop and flip; the devices' float32 steps (/255, - mean, / std) then give the very same values."""
    pixels = chestxray.load(standin, seed=0)["train"].pixels(2)
    gray = image_transforms.transform(pixels, 40, augment)
    mean, std = (np.array(values, np.float32)[:, None, None] for values in (IMAGENET_MEAN, IMAGENET_STD))
    np.testing.assert_array_equal(
        (gray.astype(np.float32) / 255 - mean) / std, normalized_on_the_host(pixels, 40, augment)
    )


def test_unreadable_image_is_named(tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png")
    with pytest.raises(InputError, match="broken.png"):
        chestxray.Split([str(broken)], np.zeros((1, 14)), np.zeros(1)).pixels(0)
