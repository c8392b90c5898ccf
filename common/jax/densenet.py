"""DenseNet-121 in Flax NNX (Huang et al. 2017), the torchvision architecture with a 14-way head.

6,968,206 trainable parameters, as in every framework of this project. Images are NHWC, JAX's native layout, and
enter as the input pipeline ships them: uint8 gray (batch, height, width). The model normalizes them on the devices
(:func:`gray_to_imagenet`), as the other frameworks' models do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from common.run.params import BATCH_NORM_MOMENTUM, IMAGENET_MEAN, IMAGENET_STD, NUM_CLASSES

GROWTH_RATE = 32
BLOCK_LAYERS = (6, 12, 24, 16)
BOTTLENECK = 4  # a dense layer's 1x1 convolution widens to BOTTLENECK * GROWTH_RATE channels
STEM_FEATURES = 64
EPSILON = 1e-5  # torchvision's BatchNorm epsilon

# torchvision starts its convolutions from Kaiming-normal weights (fan in, for ReLU), its BatchNorms from 1 and 0,
# its classifier's bias from 0; Flax's default, LeCun-normal, gives smaller weights that train differently
conv_init = nnx.initializers.he_normal()


def gray_to_imagenet(images: jax.Array, dtype=jnp.float32) -> jax.Array:
    """uint8 gray (batch, height, width) -> float (batch, height, width, 3), scaled to [0, 1] and normalized by the
    ImageNet statistics; the gray channel is repeated by broadcasting, with no RGB copy made first."""
    pixels = images[..., None].astype(jnp.float32) / 255.0
    return ((pixels - jnp.array(IMAGENET_MEAN)) / jnp.array(IMAGENET_STD)).astype(dtype)


class Layers:
    """Builds the model's BatchNorms and convolutions, all alike: one place for their settings."""

    def __init__(self, rngs: nnx.Rngs, dtype, axis_name: str | None):
        self.rngs, self.dtype, self.axis_name = rngs, dtype, axis_name

    def norm(self, features: int) -> nnx.BatchNorm:
        # Flax's momentum is the share of the running statistics kept per step, like Keras' (PyTorch's 0.1 is 1 - 0.9);
        # with an axis_name, the batch statistics are averaged over that mesh axis (synchronized BatchNorm)
        return nnx.BatchNorm(features, momentum=BATCH_NORM_MOMENTUM, epsilon=EPSILON, dtype=self.dtype,
                             axis_name=self.axis_name, rngs=self.rngs)  # fmt: skip

    def conv(self, inputs: int, outputs: int, size: int, strides: int = 1) -> nnx.Conv:
        return nnx.Conv(inputs, outputs, (size, size), strides=strides, padding=(size - 1) // 2, use_bias=False,
                        kernel_init=conv_init, dtype=self.dtype, rngs=self.rngs)  # fmt: skip


class DenseLayer(nnx.Module):
    """BN-ReLU-conv 1x1 (the bottleneck), BN-ReLU-conv 3x3: GROWTH_RATE new feature maps, concatenated to its input."""

    def __init__(self, features: int, make: Layers):
        width = BOTTLENECK * GROWTH_RATE
        self.norm1, self.conv1 = make.norm(features), make.conv(features, width, 1)
        self.norm2, self.conv2 = make.norm(width), make.conv(width, GROWTH_RATE, 3)

    def __call__(self, x):
        new = self.conv1(nnx.relu(self.norm1(x)))
        new = self.conv2(nnx.relu(self.norm2(new)))
        return jnp.concatenate([x, new], axis=-1)


class Transition(nnx.Module):
    """BN-ReLU-conv 1x1 halving the channels, then 2x2 average pooling halving the resolution."""

    def __init__(self, features: int, make: Layers):
        self.norm, self.conv = make.norm(features), make.conv(features, features // 2, 1)

    def __call__(self, x):
        return nnx.avg_pool(self.conv(nnx.relu(self.norm(x))), (2, 2), strides=(2, 2))


class DenseNet121(nnx.Module):
    """Stem (7x7 conv, max pool), four dense blocks joined by transitions, BN-ReLU, global average pool, linear head.

    ``dtype`` is the computation's (bfloat16 for mixed precision); the parameters stay float32, and the head
    computes in float32 for a stable loss. ``axis_name`` synchronizes the BatchNorms' batch statistics over that axis
    of a ``shard_map``. Returns logits.
    """

    def __init__(self, rngs: nnx.Rngs, dtype=jnp.float32, axis_name: str | None = None, num_classes: int = NUM_CLASSES):
        self.dtype = dtype
        make = Layers(rngs, dtype, axis_name)
        self.conv0, self.norm0 = make.conv(3, STEM_FEATURES, 7, strides=2), make.norm(STEM_FEATURES)
        layers, features = [], STEM_FEATURES
        for block, depth in enumerate(BLOCK_LAYERS):
            for _ in range(depth):
                layers.append(DenseLayer(features, make))
                features += GROWTH_RATE
            if block < len(BLOCK_LAYERS) - 1:
                layers.append(Transition(features, make))
                features //= 2
        self.features = nnx.List(layers)
        self.norm5 = make.norm(features)
        self.classifier = nnx.Linear(features, num_classes, bias_init=nnx.initializers.zeros_init(), rngs=rngs)

    def __call__(self, images):
        x = self.norm0(self.conv0(gray_to_imagenet(images, self.dtype)))
        x = nnx.max_pool(nnx.relu(x), (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
        for layer in self.features:
            x = layer(x)
        x = jnp.mean(nnx.relu(self.norm5(x)), axis=(1, 2))
        return self.classifier(x.astype(jnp.float32))


def trainable_parameters(model: nnx.Module) -> int:
    return sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
