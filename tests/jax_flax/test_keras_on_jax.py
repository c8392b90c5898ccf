"""Keras 3 on the JAX backend (conftest.py picks it): the Keras model every Keras notebook builds and what
Keras_JAX_MultiGPU adds, on 2 simulated CPU devices under ``keras.distribution.DataParallel``."""

import keras
import numpy as np
import pytest
from test_jax_utils import split_of

from common.data import image_transforms
from common.errors import InputError
from common.jax import utils as ju
from common.keras import model as km
from common.keras import on_jax as kj
from common.run import params
from common.run.params import IMAGENET_MEAN, IMAGENET_STD


@pytest.fixture
def data_parallel():
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=keras.distribution.list_devices("cpu")))
    yield
    keras.distribution.set_distribution(None)


def small(norm=None) -> keras.Model:
    """uint8 gray images in, 14 probabilities out, through the shared first layer (and a BatchNorm, if given)."""
    images = keras.Input((32, 32, 1), dtype="uint8")
    x = km.GrayToImageNet()(images)
    x = norm(x) if norm is not None else x
    return keras.Model(images, keras.layers.Dense(14, activation="sigmoid")(keras.layers.GlobalAveragePooling2D()(x)))


def test_the_shared_densenet_has_every_frameworks_parameters_each_replicated(data_parallel):
    model = km.build_densenet121(32)
    assert km.trainable_parameters(model) == 6_968_206
    assert all(weight.value.sharding.is_fully_replicated for weight in model.weights)
    assert len(model.weights[0].value.sharding.device_set) == 2


@pytest.mark.parametrize("steps", [5, 40])
def test_the_keras_schedule_is_the_projects_warmup_and_cosine(steps):
    schedule = km.schedule(2e-3, steps)
    for step in range(steps + 1):
        assert float(schedule(step)) == pytest.approx(2e-3 * params.schedule_factor(step, steps), abs=1e-9)


def test_training_batches_run_on_through_the_epochs_in_each_epochs_order():
    split = split_of(10)
    stream = list(kj.training_batches(split, 32, 4, seed=0, epochs=range(1, 3), threads=2))
    expected = [batch for epoch in (1, 2) for batch in ju.batches(split, 32, 4, training=True, seed=0, epoch=epoch)]
    assert len(stream) == len(expected) == 4
    for (images, labels), (want_images, want_labels) in zip(stream, expected):
        assert images.shape == (4, 32, 32, 1)
        np.testing.assert_array_equal(images[..., 0], want_images)
        np.testing.assert_array_equal(labels, want_labels)


def evaluation_batches(split) -> list[tuple]:
    data = kj.EvaluationBatches(split, 32, 4, workers=2)
    return [data[index] for index in range(len(data))]


def test_evaluation_batches_are_full_with_the_padding_weighted_0():
    split = split_of(10)
    found = evaluation_batches(split)
    assert [images.shape for images, _, _ in found] == [(4, 32, 32, 1)] * 3
    weights = np.concatenate([batch_weights for *_, batch_weights in found])
    assert weights.tolist() == [1.0] * 10 + [0.0] * 2
    labels = np.concatenate([batch_labels for _, batch_labels, _ in found])
    np.testing.assert_array_equal(labels[:10], split.labels.astype(np.float32))


def test_keras_leaves_the_padding_out_of_its_loss_and_auc(data_parallel):
    model = small()
    model.compile(
        loss=keras.losses.BinaryCrossentropy(reduction="mean_with_sample_weight"),
        weighted_metrics=[keras.metrics.AUC(multi_label=True, num_labels=14, name="auc")],
    )
    split = split_of(10)  # batches of 4, 4 and 2 padded to 4
    images = np.stack([image_transforms.transform(split.pixels(i), 32)[0] for i in range(10)])[..., np.newaxis]
    labels = split.labels.astype(np.float32)
    padded = model.evaluate(kj.EvaluationBatches(split, 32, 4, workers=2), verbose=0, return_dict=True)
    whole = model.evaluate(images, labels, batch_size=10, verbose=0, return_dict=True)
    assert padded["auc"] == pytest.approx(whole["auc"], rel=1e-6)
    last_images, last_labels, weights = evaluation_batches(split)[-1]
    last = model.evaluate(last_images, last_labels, sample_weight=weights, batch_size=4, verbose=0, return_dict=True)
    alone = model.evaluate(images[8:], labels[8:], batch_size=2, verbose=0, return_dict=True)
    assert last["loss"] == pytest.approx(alone["loss"], rel=1e-6)


def test_precise_bn_averages_the_statistics_of_whole_batches(data_parallel):
    norm = keras.layers.BatchNormalization(momentum=0.9)
    model = small(norm)
    data = list(kj.training_batches(split_of(12), 32, 4, seed=0, epochs=range(1), threads=2))  # 3 batches
    kj.recompute_batch_norm_statistics(model, data, batches=2)
    # over each whole batch of 4 (not per device): the mean of the two batches' statistics
    normalized = [(images / 255 - np.float32(IMAGENET_MEAN)) / np.float32(IMAGENET_STD) for images, _ in data[:2]]
    expected_mean = np.mean([batch.mean(axis=(0, 1, 2)) for batch in normalized], axis=0)
    expected_variance = np.mean([batch.var(axis=(0, 1, 2)) for batch in normalized], axis=0)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(norm.moving_mean), expected_mean, rtol=1e-5)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(norm.moving_variance), expected_variance, rtol=1e-4)
    assert norm.momentum == 0.9, "the momentum is put back"


def test_precision_sets_the_policy():
    try:
        assert kj.set_precision("mixed") == "mixed_bfloat16" == keras.mixed_precision.global_policy().name
        assert kj.set_precision("fp32") == "float32" == keras.mixed_precision.global_policy().name
        with pytest.raises(InputError, match="PRECISION"):
            kj.set_precision("fp16")
    finally:
        keras.mixed_precision.set_global_policy("float32")
