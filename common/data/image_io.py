"""The one rule that turns an image file into 8-bit gray pixels, the same for every framework.

The prepare step and every framework's pipeline (through :meth:`common.data.chestxray.Split.pixels`) decode with it.
Pillow's ``convert("L")`` clips 16-bit gray to 255 (a 16-bit X-ray comes out almost all white), so 16-bit gray keeps
its high byte instead, as ``tf.io.decode_png`` does.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from common.errors import InputError

# The modes Pillow opens 16-bit gray PNGs in (older versions: "I").
SIXTEEN_BIT_GRAY = ("I;16", "I;16B", "I;16L", "I")


def read_gray(path) -> np.ndarray:
    """The image at ``path`` as uint8 gray, shape (height, width): the pixels of :func:`open_gray`."""
    return np.array(open_gray(path))


def open_gray(path) -> Image.Image:
    """The image at ``path`` as a decoded Pillow image in mode "L".

    16-bit gray becomes ``value >> 8``; every other mode Pillow's ``convert("L")``: alpha dropped, palettes
    expanded, color weighted ``(R*19595 + G*38470 + B*7471 + 0x8000) >> 16``. A gray image is returned as it
    was decoded, without a copy: the prepare step decodes 112,120 of them.
    """
    try:
        with Image.open(path) as image:
            image.load()  # the whole file now: a truncated one fails here, not in a later step
            if image.mode in SIXTEEN_BIT_GRAY:
                return Image.fromarray((np.clip(np.asarray(image, np.int32), 0, 65535) >> 8).astype(np.uint8))
            return image if image.mode == "L" else image.convert("L")
    except (OSError, ValueError, SyntaxError) as error:  # Pillow reports a broken PNG chunk as SyntaxError
        raise InputError(f"Cannot read image {path} ({error}): replace or remove the file.") from None
