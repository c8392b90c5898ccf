"""Keras 3 on either backend: the DenseNet-121 and the ``model.fit`` callbacks that Keras_TF_MultiGPU (TensorFlow)
and Keras_JAX_MultiGPU (JAX) share, written with ``keras.ops`` only.

Keras picks its backend when it is first imported: ``KERAS_BACKEND``, TensorFlow where it is unset. On TensorFlow,
:mod:`common.tensorflow.imports` loads it first, so that TensorFlow's start-up notices are caught there.
"""

import os

if os.environ.get("KERAS_BACKEND", "tensorflow") == "tensorflow":
    import common.tensorflow.imports  # noqa: F401  (before Keras imports TensorFlow itself)
