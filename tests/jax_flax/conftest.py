"""Before any test module here imports JAX or Keras: 2 simulated CPU devices (JAX fixes them when its CPU backend
starts) and Keras on its JAX backend (picked when Keras is first imported)."""

import os

import jax

os.environ["KERAS_BACKEND"] = "jax"
jax.config.update("jax_num_cpu_devices", 2)
