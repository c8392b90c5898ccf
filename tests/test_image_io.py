"""Every framework's pipeline decodes a PNG of every mode the data set's copies hold to the same 8-bit pixels."""

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from common import image_io
from common import tf_utils as tfu
from common import torch_utils as tu
from common.chestxray import Split
from common.errors import InputError

MODES = ("L", "LA", "RGB", "RGBA", "P", "I;16")
HEIGHT, WIDTH = 12, 20  # not square, so a swapped height and width shows


def _luma(rgb: np.ndarray) -> np.ndarray:
    weighted = rgb[..., :3].astype(np.int64) @ np.array([19595, 38470, 7471])
    return ((weighted + 0x8000) >> 16).astype(np.uint8)


def _write(folder, mode: str):
    """A PNG of random pixels in ``mode`` and the 8-bit gray pixels it should decode to."""
    rng = np.random.default_rng(MODES.index(mode))
    if mode == "I;16":
        values = rng.integers(0, 65535, (HEIGHT, WIDTH), dtype=np.uint16, endpoint=True)
        values[0, :2] = 0, 65535
        image, expected = Image.fromarray(values), (values >> 8).astype(np.uint8)
    elif mode == "P":
        indices = rng.integers(0, 255, (HEIGHT, WIDTH), dtype=np.uint8, endpoint=True)
        palette = rng.integers(0, 255, (256, 3), dtype=np.uint8, endpoint=True)
        image, expected = Image.fromarray(indices), _luma(palette[indices])
        image.putpalette(palette.tobytes())
    else:
        channels = len(mode)
        pixels = rng.integers(0, 255, (HEIGHT, WIDTH, channels), dtype=np.uint8, endpoint=True)
        image = Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels)
        expected = _luma(pixels) if mode.startswith("RGB") else pixels[..., 0]
    assert image.mode == mode
    path = folder / f"{mode.replace(';', '')}.png"
    image.save(path)
    return str(path), expected


@pytest.mark.parametrize("mode", MODES)
def test_every_framework_decodes_the_same_pixels(tmp_path, mode):
    path, expected = _write(tmp_path, mode)
    with Image.open(path) as image:
        assert image.mode == mode, "the file holds the mode under test"
    decoded = {
        "image_io": image_io.read_gray(path),
        "tensorflow": tfu._decode(tf.constant(path)).numpy(),
        # PyTorch's dataset, Gluon's and Chainer's all read a split's pixels
        "pytorch": tu.ChestXrayDataset(Split([path], np.zeros((1, 14)), np.zeros(1)), lambda x: x)[0][0].numpy(),
        "gluon and chainer": Split([path], np.zeros((1, 14)), np.zeros(1)).pixels(0),
    }
    assert decoded["tensorflow"].shape == (HEIGHT, WIDTH, 1) and decoded["pytorch"].shape == (1, HEIGHT, WIDTH)
    for framework, pixels in decoded.items():
        assert pixels.dtype == np.uint8, framework
        np.testing.assert_array_equal(pixels.reshape(HEIGHT, WIDTH), expected, err_msg=framework)


def test_sixteen_bit_gray_keeps_its_high_byte_and_is_not_white(tmp_path):
    path, expected = _write(tmp_path, "I;16")
    pixels = image_io.read_gray(path)
    assert abs(pixels.mean() - expected.mean()) < 0.5 and pixels.mean() < 160, "not clipped to white"


def test_truncated_image_is_named(tmp_path):
    path, _ = _write(tmp_path, "RGB")
    with open(path, "rb") as file:
        data = file.read()
    with open(path, "wb") as file:
        file.write(data[: len(data) // 2])
    with Image.open(path) as image:  # the header still reads: only a full decode finds the damage
        assert image.size == (WIDTH, HEIGHT)
    with pytest.raises(InputError, match=r"Cannot read image .*RGB\.png.*replace or remove the file"):
        image_io.read_gray(path)
