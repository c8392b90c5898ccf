"""The one decode rule: a PNG of every mode the data set's copies hold gives the same 8-bit gray pixels."""

import numpy as np
import pytest
from PIL import Image
from png_modes import HEIGHT, MODES, WIDTH, write

from common.data import image_io
from common.data.chestxray import Split
from common.errors import InputError


@pytest.mark.parametrize("mode", MODES)
def test_the_decode_rule_and_a_splits_pixels_give_the_expected_pixels(tmp_path, mode):
    """The rule every framework follows (each framework's tests hold its own pipeline to it); Gluon's and Chainer's
    datasets read a split's pixels, as PyTorch's does."""
    path, expected = write(tmp_path, mode)
    with Image.open(path) as image:
        assert image.mode == mode, "the file holds the mode under test"
    decoded = {
        "image_io": image_io.read_gray(path),
        "a split's pixels": Split([path], np.zeros((1, 14)), np.zeros(1)).pixels(0),
    }
    for way, pixels in decoded.items():
        assert pixels.dtype == np.uint8 and pixels.shape == (HEIGHT, WIDTH), way
        np.testing.assert_array_equal(pixels, expected, err_msg=way)


def test_sixteen_bit_gray_keeps_its_high_byte_and_is_not_white(tmp_path):
    path, expected = write(tmp_path, "I;16")
    pixels = image_io.read_gray(path)
    assert abs(pixels.mean() - expected.mean()) < 0.5 and pixels.mean() < 160, "not clipped to white"


def test_truncated_image_is_named(tmp_path):
    path, _ = write(tmp_path, "RGB")
    with open(path, "rb") as file:
        data = file.read()
    with open(path, "wb") as file:
        file.write(data[: len(data) // 2])
    with Image.open(path) as image:  # the header still reads: only a full decode finds the damage
        assert image.size == (WIDTH, HEIGHT)
    with pytest.raises(InputError, match=r"Cannot read image .*RGB\.png.*replace or remove the file"):
        image_io.read_gray(path)
