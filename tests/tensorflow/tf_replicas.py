"""One training step of a small model under tf.distribute on 1 and on 2 logical CPU devices.

Run as a script (``python tf_replicas.py``) by ``test_tf_utils.py``: TensorFlow fixes its logical
devices once per process, so the 2-device setup needs a process of its own. Prints one JSON object.
"""

import json

import keras
import numpy as np
import tensorflow as tf

from common.keras import model as km
from common.run import devices
from common.tensorflow import utils as tfu

GLOBAL_BATCH = 8


def make_model(batch_norm: bool = False) -> keras.Model:
    """Fed as the notebooks' DenseNet is: uint8 gray images, normalized by the model on each replica."""
    keras.utils.set_random_seed(0)
    layers = [keras.Input((8, 8, 1), dtype="uint8"), km.GrayToImageNet(), keras.layers.Conv2D(4, 3, padding="same")]
    if batch_norm:
        layers.append(keras.layers.BatchNormalization(momentum=0.5))
    layers += [keras.layers.ReLU(), keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(14)]
    return keras.Sequential(layers)


def make_batch():
    generator = np.random.default_rng(1)
    images = generator.integers(0, 256, (GLOBAL_BATCH, 8, 8, 1), dtype=np.uint8)
    labels = (generator.random((GLOBAL_BATCH, 14)) < 0.5).astype(np.float32)
    return images, labels


def one_step(strategy, loss_batch: int = GLOBAL_BATCH, batch_norm: bool = False):
    """The weights after one SGD step with the notebooks' loss reduction over ``loss_batch`` images."""
    with strategy.scope():
        model = make_model(batch_norm)
        optimizer = keras.optimizers.SGD(0.5)  # plain SGD: Adam would hide a wrongly scaled gradient

    def step(images, labels):
        with tf.GradientTape() as tape:
            loss = tfu.replica_loss(labels, model(images, training=True), loss_batch)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    @tf.function
    def distributed_step(batch):
        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(step, args=batch), axis=None)

    data = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors(make_batch()))
    loss = float(distributed_step(next(iter(data))))
    trained = [variable.numpy() for variable in model.trainable_weights]
    if not batch_norm:
        return loss, trained
    moving_mean = next(variable for variable in model.weights if "moving_mean" in variable.path)
    copies = [value.numpy().tolist() for value in moving_mean.value.values]  # each replica's own
    tfu.share_batch_norm_statistics(model)
    shared = [value.numpy().tolist() for value in moving_mean.value.values]
    tfu.recompute_batch_norm_statistics(model, tf.data.Dataset.from_tensors(make_batch()), batches=1)
    recomputed = [value.numpy().tolist() for value in moving_mean.value.values]
    return trained, copies, shared, recomputed


def tracings(strategy) -> dict[str, int]:
    """How often the notebook's distributed functions are traced by one training step, the benchmark and two
    evaluations of two splits whose last batches are partial."""
    with strategy.scope():
        model = make_model()
        optimizer = keras.optimizers.SGD(0.1)

    def step(images, labels):
        with tf.GradientTape() as tape:
            loss = tfu.replica_loss(labels, model(images, training=True), GLOBAL_BATCH)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    def predict_step(images, labels):
        return labels, tf.sigmoid(model(images, training=False))

    @tf.function
    def distributed_train_step(batch):
        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(step, args=batch), axis=None)

    @tf.function(reduce_retracing=True)
    def distributed_predict_step(batch):
        labels, scores = strategy.run(predict_step, args=batch)
        return strategy.gather(labels, axis=0), strategy.gather(scores, axis=0)

    def split(images: int, training: bool = False) -> tf.data.Dataset:
        images, labels = (np.resize(part, (images, *part.shape[1:])) for part in make_batch())
        return tf.data.Dataset.from_tensor_slices((images, labels)).batch(GLOBAL_BATCH, drop_remainder=training)

    train = split(GLOBAL_BATCH, training=True).repeat()  # full batches only, as tfu.dataset trains
    distributed_train_step(next(iter(strategy.experimental_distribute_dataset(train))))
    rate = tfu.time_steps(strategy, distributed_train_step, GLOBAL_BATCH // strategy.num_replicas_in_sync, 8, 1)
    scored = []
    for images in (20, 20, 11):  # validation twice (two epochs), then a test split: partial last batches of 4 and 3
        labels, _ = tfu.predict_all(distributed_predict_step, strategy.experimental_distribute_dataset(split(images)))
        scored.append(len(labels))
    return {
        "train": distributed_train_step.experimental_get_tracing_count(),
        "predict": distributed_predict_step.experimental_get_tracing_count(),
        "scored": scored,
        "benchmark_images_per_second": rate,
    }


def fit_step(strategy):
    """The weights after one step of ``model.fit``, as the Keras notebook trains."""
    with strategy.scope():
        model = make_model()
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=keras.losses.BinaryCrossentropy(from_logits=True))
    images, labels = make_batch()
    data = tf.data.Dataset.from_tensors((images, labels))
    model.fit(data, epochs=1, verbose=0)
    return [variable.numpy() for variable in model.trainable_weights]


def adam_steps(strategy, optimizer_class, steps: int = 3) -> tuple[list, float, float]:
    """The weights and Adam's slots after ``steps`` steps of ``optimizer_class``, how far the replicas' copies of
    them are apart, and how far the weights moved."""
    with strategy.scope():
        model = make_model()
        optimizer = optimizer_class(keras.optimizers.schedules.CosineDecay(0.01, decay_steps=10))
    initial = [variable.numpy() for variable in model.trainable_weights]

    def step(images, labels):
        with tf.GradientTape() as tape:
            loss = tfu.replica_loss(labels, model(images, training=True), GLOBAL_BATCH)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    @tf.function
    def distributed_step(batch):
        strategy.run(step, args=batch)

    batches = iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors(make_batch()).repeat()))
    for _ in range(steps):
        distributed_step(next(batches))
    state = [*model.trainable_weights, *optimizer._momentums, *optimizer._velocities]
    copies = [[value.numpy() for value in getattr(variable.value, "values", [variable.value])] for variable in state]
    first = [values[0] for values in copies]
    apart = max(float(np.abs(copy - values[0]).max()) for values in copies for copy in values)
    return first, apart, max_difference(first[: len(initial)], initial)


def max_difference(a: list, b: list) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


def main() -> None:
    names = tfu.configure_devices(devices.resolve(2, gpus=[], cores=2))
    initial = [variable.numpy() for variable in make_model().trainable_weights]
    report = {"devices": names, "grappler": tf.config.optimizer.get_experimental_options()}
    one_device = {}  # the weights after one step on one device, per strategy
    for name in ("mirrored", "central_storage"):
        one = tfu.make_strategy(name, names[:1], "cpu")
        two = tfu.make_strategy(name, names, "cpu")
        loss1, weights1 = one_step(one)
        loss2, weights2 = one_step(two)
        _, wrongly_reduced = one_step(two, loss_batch=GLOBAL_BATCH // 2)  # each replica's mean: 2x the step
        one_device[name], fit1 = weights1, fit_step(one)
        report[name] = {
            "replicas": two.num_replicas_in_sync,
            "loss": [loss1, loss2],
            "two_vs_one": max_difference(weights2, weights1),
            "wrong_reduction_vs_one": max_difference(wrongly_reduced, weights1),
            "step_size": max_difference(weights1, initial),
            "fit_two_vs_one": max_difference(fit_step(two), fit1),
            "fit_vs_custom_loop": max_difference(fit1, weights1),
        }
    # Without TF_CONFIG, MultiWorkerMirroredStrategy is one worker with one replica on a CPU.
    multi_worker = tfu.make_strategy("multi_worker", names, "cpu")
    _, weights_multi = one_step(multi_worker)
    report["multi_worker"] = {
        "replicas": multi_worker.num_replicas_in_sync,
        "vs_one": max_difference(weights_multi, one_device["mirrored"]),
    }
    trained1, moving1, _, _ = one_step(tfu.make_strategy("mirrored", names[:1], "cpu"), batch_norm=True)
    trained2, moving2, shared, recomputed = one_step(tfu.make_strategy("mirrored", names, "cpu"), batch_norm=True)
    report["batch_norm"] = {
        "one_device_moving_mean": moving1[0],
        "replica_moving_means": moving2,
        "shared_moving_means": shared,
        "recomputed_moving_means": recomputed,
        "trained_two_vs_one": max_difference(trained2, trained1),
    }
    keras_adam, _, _ = adam_steps(tfu.make_strategy("mirrored", names, "cpu"), keras.optimizers.Adam)
    fused_adam, apart, moved = adam_steps(tfu.make_strategy("mirrored", names, "cpu"), tfu.Adam)
    fused_one, _, _ = adam_steps(tfu.make_strategy("mirrored", names[:1], "cpu"), tfu.Adam)
    fused_central, _, _ = adam_steps(tfu.make_strategy("central_storage", names, "cpu"), tfu.Adam)
    report["adam"] = {
        "fused_vs_keras": max_difference(fused_adam, keras_adam),
        "replicas_apart": apart,
        "two_vs_one": max_difference(fused_adam, fused_one),
        "central_storage_vs_mirrored": max_difference(fused_central, fused_adam),
        "moved": moved,
    }
    report["tracings"] = {
        str(len(used)): tracings(tfu.make_strategy("mirrored", used, "cpu")) for used in (names[:1], names)
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
