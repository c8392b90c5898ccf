"""The Keras DenseNet-121 of every Keras notebook and its learning-rate schedule, on any Keras backend."""

from __future__ import annotations

import keras
import numpy as np

from common.run import params
from common.run.params import BATCH_NORM_MOMENTUM, IMAGENET_MEAN, IMAGENET_STD, NUM_CLASSES


@keras.saving.register_keras_serializable(package="common")
class GrayToImageNet(keras.layers.Layer):
    """uint8 gray images (batch, height, width, 1) as the network takes them: scaled to [0, 1], the gray repeated into
    3 channels, normalized by the ImageNet statistics, as every framework of this project feeds its DenseNet.

    The first layer of the model, so that it runs on the devices: the input pipeline ships 1 byte per pixel instead of
    the 12 of three float32 channels. It has no weights. It normalizes in float32, then casts to the compute dtype of
    the policy (bfloat16 under ``mixed_bfloat16``).
    """

    def call(self, images):
        pixels = keras.ops.cast(images, "float32") / 255.0
        # broadcasting the gray channel against 3 channels' statistics repeats it, with no RGB copy made first
        normalized = (pixels - np.float32(IMAGENET_MEAN)) / np.float32(IMAGENET_STD)
        return keras.ops.cast(normalized, self.compute_dtype)

    def compute_output_shape(self, input_shape):
        return (*input_shape[:-1], 3)


def build_densenet121(image_size: int, pretrained: bool = False, activation: str | None = None) -> keras.Model:
    """Keras' DenseNet-121 with a 14-way head (6,968,206 trainable parameters); build it inside a strategy scope
    (TensorFlow) or after setting the distribution (JAX).

    It takes the input pipeline's uint8 gray batches (batch, size, size, 1) and normalizes them itself
    (:class:`GrayToImageNet`). ``activation=None`` gives logits, ``"sigmoid"`` probabilities. The head computes in
    float32 also under a mixed-precision policy, for a stable loss.
    """
    images = keras.Input((image_size, image_size, 1), dtype="uint8", name="images")
    base = keras.applications.DenseNet121(
        weights="imagenet" if pretrained else None,
        include_top=False,
        input_tensor=GrayToImageNet(name="gray_to_imagenet")(images),
        input_shape=(image_size, image_size, 3),
        pooling="avg",
    )
    for layer in base.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.momentum = BATCH_NORM_MOMENTUM
        elif isinstance(layer, keras.layers.Conv2D) and not pretrained:
            # torchvision starts its convolutions from Kaiming-normal weights, Keras from Glorot-uniform ones,
            # which are smaller: the same Adam step then moves them further, the batch statistics drift
            # faster than the running averages follow, and evaluation suffers in a short run.
            layer.kernel.assign(keras.initializers.HeNormal()(layer.kernel.shape))
    head = keras.layers.Dense(NUM_CLASSES, activation=activation, dtype="float32", name="predictions")
    return keras.Model(images, head(base.output), name="densenet121")


def trainable_parameters(model: keras.Model) -> int:
    return int(sum(np.prod(weight.shape) for weight in model.trainable_weights))


def schedule(learning_rate: float, steps: int) -> keras.optimizers.schedules.LearningRateSchedule:
    """The schedule of every notebook over ``steps`` steps (:func:`common.run.params.schedule_factor`): up from 0 to
    ``learning_rate`` over the warmup, then down a cosine to 0."""
    warmup = params.warmup_steps(steps)
    return keras.optimizers.schedules.CosineDecay(
        0.0, decay_steps=steps - warmup, warmup_target=learning_rate, warmup_steps=warmup
    )
