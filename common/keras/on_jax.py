"""Keras 3 on the JAX backend: what Keras_JAX_MultiGPU needs beside the shared model and callbacks (the input pipeline,
the precision policy, precise BN, the in-RAM benchmark's batch).

``model.fit`` on JAX takes Grain datasets as they are. Under ``keras.distribution.DataParallel`` every batch is split
into equal shares, one per device, so the evaluation batches are padded to the full batch, with a sample weight of 0
on the padding: the loss (``reduction="mean_with_sample_weight"``) and the ``weighted_metrics`` leave it out, and
:class:`common.keras.callbacks.ExactAUC` and the test drop its scores.
"""

from __future__ import annotations

import itertools

import grain
import jax
import keras
import numpy as np

from common.jax import utils as ju
from common.run import params


def _with_channel(images: np.ndarray) -> np.ndarray:
    return images[..., np.newaxis]  # (batch, size, size, 1), as the model takes them; a view, no copy


def training_batches(split, image_size: int, batch_size: int, seed: int, epochs: range, threads: int):
    """The training batches of ``epochs`` in one stream, each epoch in the order and with the augmentation that
    :func:`common.jax.utils.epoch_batches` gives it; ``model.fit(steps_per_epoch=...)`` reads on through it from epoch
    to epoch, and a resumed run's stream starts at its first epoch."""
    stream = grain.MapDataset.concatenate(
        [ju.epoch_batches(split, image_size, batch_size, True, seed, epoch) for epoch in epochs]
    )
    return ju.read_ahead(stream.map(lambda batch: (_with_channel(batch[0]), batch[1])), threads, batch_size)


class EvaluationBatches(keras.utils.PyDataset):
    """Every image of ``split`` once, in order, as (images, labels, sample weights): the last batch padded to
    ``batch_size`` with weight 0, so that each device gets its equal share of every batch. A Keras ``PyDataset``
    (``workers`` threads read batches ahead) rather than a Grain stream, whose length Keras does not take: it knows
    where a pass over the split ends, for ``evaluate``, ``predict`` and ``fit``'s validation alike."""

    def __init__(self, split, image_size: int, batch_size: int, workers: int):
        super().__init__(workers=workers)
        self.batches, self.batch_size = ju.epoch_batches(split, image_size, batch_size, False, 0), batch_size

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int):
        images, labels = self.batches[index]
        weights = (np.arange(self.batch_size) < len(images)).astype(np.float32)
        return _with_channel(ju.padded(images, self.batch_size)), ju.padded(labels, self.batch_size), weights


def set_precision(precision: str) -> str:
    """Set the Keras policy: ``mixed_bfloat16`` for ``"mixed"`` (float32's range, no loss scaling; JAX computes
    bfloat16 on CPUs and GPUs alike), else ``float32``."""
    policy = "mixed_bfloat16" if params.check_precision(precision) == "mixed" else "float32"
    keras.mixed_precision.set_global_policy(policy)
    return policy


def _on_devices(array: np.ndarray):
    """``array`` split over the devices as ``model.fit`` splits a batch (whole, without a distribution)."""
    distribution = keras.distribution.distribution()
    if distribution is None:
        return array
    return keras.distribution.distribute_tensor(array, distribution.get_data_layout(array.shape))


def recompute_batch_norm_statistics(model: keras.Model, data, batches: int) -> None:
    """Replace the BatchNorm running averages by the mean statistics of ``batches`` batches of ``data`` ("precise
    BN", as PyTorch's ``update_bn``): each batch's statistics come from one jitted training-mode forward pass
    (``model.stateless_call``) with the momentum at 0, then they are averaged. One program sees the whole batch, so
    every device gets the same statistics."""
    norms = [layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)]
    momentum = [layer.momentum for layer in norms]

    @jax.jit
    def batch_statistics(trainable, non_trainable, images):
        _, updated = model.stateless_call(trainable, non_trainable, images, training=True)
        return updated

    trainable = [variable.value for variable in model.trainable_variables]
    non_trainable = [variable.value for variable in model.non_trainable_variables]
    try:
        for layer in norms:
            layer.momentum = 0.0  # read as the step is traced: the running statistics become the batch's
        # one batch at a time (see common.jax.utils.recompute_batch_norm_statistics)
        found = [
            jax.block_until_ready(batch_statistics(trainable, non_trainable, _on_devices(images)))
            for images, *_ in itertools.islice(data, batches)
        ]
    finally:
        for layer, kept in zip(norms, momentum, strict=True):
            layer.momentum = kept
    for variable, *values in zip(model.non_trainable_variables, *found, strict=True):
        variable.assign(sum(values) / len(values))


def random_batches(global_batch: int, image_size: int, seed: int = 0):
    """:func:`common.jax.utils.random_batch` with its channel axis, repeated without end: the in-RAM benchmark's
    input."""
    images, labels = ju.random_batch(global_batch, image_size, seed)
    return grain.MapDataset.source([(_with_channel(images), labels)]).repeat().to_iter_dataset()
