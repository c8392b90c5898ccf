"""TensorFlow and Keras helpers: importable only in the ``tensorflow`` environment (kernel ``multigpu-tensorflow``).
Import TensorFlow through ``common.tensorflow.imports``."""
