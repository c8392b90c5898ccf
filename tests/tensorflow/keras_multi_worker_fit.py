"""One worker of Keras 3 ``model.fit`` under ``MultiWorkerMirroredStrategy`` (the cluster is in ``TF_CONFIG``).

Run by tests/test_multinode.py as two workers on one machine, to hold the Keras notebook's refusal of
``STRATEGY="multi_worker"`` to the truth: today ``fit`` fails (keras-team/keras#20585).
"""

import json
import os

import numpy as np
import tensorflow as tf

strategy = tf.distribute.MultiWorkerMirroredStrategy()  # reads TF_CONFIG; must come before other TF work
import keras  # noqa: E402  (after the strategy: TensorFlow's runtime must not start before it)

task = json.loads(os.environ["TF_CONFIG"])["task"]
keras.utils.set_random_seed(0)
images = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
labels = (images[:, :2] > 0).astype("float32")
with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss=keras.losses.BinaryCrossentropy(from_logits=True))
model.fit(images, labels, batch_size=16, epochs=1, verbose=2)
print(f"worker {task['index']}: model.fit finished under MultiWorkerMirroredStrategy", flush=True)
