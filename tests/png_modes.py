"""PNGs of every mode the copies of ChestX-ray14 hold, with the 8-bit gray pixels each must decode to: every
framework's pipeline is held to the same pixels (tests/test_image_io.py and each framework's tests)."""

import numpy as np
from PIL import Image

MODES = ("L", "LA", "RGB", "RGBA", "P", "I;16")
HEIGHT, WIDTH = 12, 20  # not square, so a swapped height and width shows


def luma(rgb: np.ndarray) -> np.ndarray:
    weighted = rgb[..., :3].astype(np.int64) @ np.array([19595, 38470, 7471])
    return ((weighted + 0x8000) >> 16).astype(np.uint8)


def write(folder, mode: str):
    """A PNG of random pixels in ``mode`` and the 8-bit gray pixels it should decode to."""
    rng = np.random.default_rng(MODES.index(mode))
    if mode == "I;16":
        values = rng.integers(0, 65535, (HEIGHT, WIDTH), dtype=np.uint16, endpoint=True)
        values[0, :2] = 0, 65535
        image, expected = Image.fromarray(values), (values >> 8).astype(np.uint8)
    elif mode == "P":
        indices = rng.integers(0, 255, (HEIGHT, WIDTH), dtype=np.uint8, endpoint=True)
        palette = rng.integers(0, 255, (256, 3), dtype=np.uint8, endpoint=True)
        image, expected = Image.fromarray(indices), luma(palette[indices])
        image.putpalette(palette.tobytes())
    else:
        channels = len(mode)
        pixels = rng.integers(0, 255, (HEIGHT, WIDTH, channels), dtype=np.uint8, endpoint=True)
        image = Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels)
        expected = luma(pixels) if mode.startswith("RGB") else pixels[..., 0]
    assert image.mode == mode
    path = folder / f"{mode.replace(';', '')}.png"
    image.save(path)
    return str(path), expected
