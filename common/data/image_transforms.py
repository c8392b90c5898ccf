"""Decode and augment one image with Pillow and numpy, for the Gluon and Chainer notebooks.

The same steps as the PyTorch pipeline (torchvision) and the TensorFlow one (tf.image): a random resized
crop (``CROP_SCALE``, aspect 3/4 to 4/3) and a horizontal flip for training, resize and center crop for
evaluation. The result stays one uint8 gray channel: the decode processes pass it to the training process and on
to the devices, where each framework's ``normalize`` (``common.mxnet.utils``, ``common.chainer.utils``) makes the
three ImageNet-normalized float32 channels the model takes, 12 times the bytes. The randomness comes from
``(seed, epoch, index)``, so an image gets the same crop whichever process decodes it.
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image, ImageOps

from common.run.params import CROP_SCALE


def random_crop_box(width: int, height: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop box: area share in ``CROP_SCALE``, aspect ratio 3/4 to 4/3."""
    for _ in range(10):
        area = width * height * rng.uniform(*CROP_SCALE)
        aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        w, h = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
        if 0 < w <= width and 0 < h <= height:
            left, top = rng.integers(0, width - w + 1), rng.integers(0, height - h + 1)
            return int(left), int(top), int(left + w), int(top + h)
    return 0, 0, width, height  # the whole image, as torchvision does for in-range aspect ratios


def transform(pixels: np.ndarray, image_size: int, augment: tuple[int, int, int] | None = None) -> np.ndarray:
    """Gray uint8 ``pixels`` (a split's :meth:`~common.data.chestxray.Split.pixels`) cropped to a uint8 array
    (1, size, size); ``augment=(seed, epoch, index)`` for training."""
    image = Image.fromarray(pixels)
    size = (image_size, image_size)
    if augment is None:  # the short side resized to the image size, then the center crop
        image = ImageOps.fit(image, size, Image.BILINEAR)
    else:
        rng = np.random.default_rng(list(augment))
        image = image.resize(size, Image.BILINEAR, box=random_crop_box(*image.size, rng))
        if rng.random() < 0.5:
            image = ImageOps.mirror(image)
    return np.asarray(image, np.uint8)[None]
