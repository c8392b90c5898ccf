"""The JAX notebook's bookkeeping: devices, input pipeline, schedule, precise BN, evaluation, benchmark, checkpoints.

The parallelism itself (the mesh, the shardings, the jitted and the ``shard_map`` steps) is written out in the
notebook. :func:`configure_devices` must run before anything else touches JAX's devices: the CPU backend fixes how
many devices it simulates when it starts.
"""

from __future__ import annotations

import os
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import PartitionSpec as P

from common.data import image_transforms
from common.measure.phases import timed_steps
from common.run import checkpoints, params, protocol
from common.run import devices as common_devices
from common.run.params import NUM_CLASSES

PARALLELISMS = ("data", "fsdp")
# Two ways to compute the same float32 step (one partitioned by XLA, one written per device) agree to rounding, as a
# share of the largest gradient: their sums run in other orders, and 121 BatchNorms over a few images amplify the
# last bits on the way back (about 1e-3 on one device, 1e-7 on two, measured). A step that skips the all-reduce is off
# by a large share of the gradient itself.
ROUNDING = 1e-2
ADAM_B1 = 0.9  # optax.adam's default decay of the first moment
# Compiled steps are kept here between runs: XLA compiles DenseNet-121's training step in tens of seconds on a CPU,
# and a rerun with the same shapes (the exercises, a resumed run) loads it instead
COMPILATION_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "multigpu-jax"


def configure_devices(hardware: common_devices.Devices) -> list:
    """The ``hardware.count`` devices JAX should use: GPUs, or the CPU split into that many simulated devices.

    Call it before any other JAX call: the CPU backend reads ``jax_num_cpu_devices`` when it starts.
    """
    jax.config.update("jax_compilation_cache_dir", str(COMPILATION_CACHE))
    # the small programs too (by default JAX keeps those that took 1 s or more): building the model compiles an
    # initializer for each of its 148 weight shapes, 14 s on 2 cores, against 3 s loaded from the cache
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if hardware.kind == "cpu":
        jax.config.update("jax_num_cpu_devices", hardware.count)
        return jax.devices("cpu")
    try:
        gpus = jax.devices("gpu")
    except RuntimeError as error:  # a CPU-only jaxlib, or CUDA libraries it cannot load
        common_devices.require_usable(hardware, f"JAX {jax.__version__}", 0, None, str(error).splitlines()[0])
        raise
    common_devices.require_usable(hardware, f"JAX {jax.__version__}", len(gpus), None)
    return gpus[: hardware.count]


def compute_dtype(precision: str):
    """The dtype the layers compute in: bfloat16 for ``"mixed"`` (float32 range, no loss scaling), else float32."""
    return jnp.bfloat16 if params.check_precision(precision) == "mixed" else jnp.float32


def schedule(learning_rate: float, steps: int) -> optax.Schedule:
    """The project's schedule (``common.run.params.schedule_factor``): a linear warmup from 0, then a cosine to 0."""
    warmup = params.warmup_steps(steps)
    return optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup, steps, 0.0)


def epoch_batches(split, image_size: int, batch_size: int, training: bool, seed: int, epoch: int = 0):
    """One epoch of (uint8 gray images (batch, size, size), float32 labels (batch, 14)) numpy batches, as a Grain
    ``MapDataset``.

    Training: a new order every epoch, full batches only, each image augmented from ``(seed, epoch, index)`` by
    :mod:`common.data.image_transforms` (as Gluon and Chainer do), so a resumed run sees the same images. Evaluation:
    every image once, in order, the last batch partial.
    """
    labels = split.labels.astype(np.float32)
    order = np.random.default_rng([seed, epoch]).permutation(len(split)) if training else np.arange(len(split))

    def read(index):
        augment = (seed, epoch, int(index)) if training else None
        return image_transforms.transform(split.pixels(int(index)), image_size, augment)[0], labels[index]

    return grain.MapDataset.source(order).map(read).batch(batch_size, drop_remainder=training)


def read_ahead(dataset, threads: int, batch_size: int):
    """``dataset`` (a Grain ``MapDataset``) read by ``threads`` at once, batches kept ready ahead."""
    return dataset.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=2 * batch_size))


def batches(split, image_size: int, batch_size: int, training: bool, seed: int, epoch: int = 0, threads: int = 2):
    """:func:`epoch_batches`, read by ``threads`` at once (:func:`read_ahead`)."""
    return read_ahead(epoch_batches(split, image_size, batch_size, training, seed, epoch), threads, batch_size)


def padded(array: np.ndarray, rows: int) -> np.ndarray:
    """``array`` with its first axis padded to ``rows`` by repeating its last row: every evaluation batch gets the
    full batch's shape, so the step compiled for it serves the last, partial batch too; the padding's outputs are
    dropped."""
    missing = rows - len(array)
    return np.concatenate([array, np.repeat(array[-1:], missing, axis=0)]) if missing else array


def predict_all(predict_step, data, sharding, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Labels and sigmoid scores of every image of ``data`` (an evaluation :func:`batches` of ``batch_size``), in
    order; each batch is sharded over the devices with ``sharding`` (the last one padded, its padding dropped)."""
    labels, scores = [], []
    for images, batch_labels in data:
        scored = predict_step(jax.device_put(padded(images, batch_size), sharding))
        labels.append(batch_labels)
        scores.append(np.asarray(scored)[: len(images)])
    return np.concatenate(labels), np.concatenate(scores)


def recompute_batch_norm_statistics(model: nnx.Module, data, batches_used: int, sharding) -> None:
    """Replace the BatchNorm running averages by the mean statistics of ``batches_used`` training batches ("precise
    BN", as PyTorch's ``update_bn``): each batch's statistics are taken with the running averages' momentum at 0,
    then averaged."""
    norms = [module for _, module in nnx.iter_modules(model) if isinstance(module, nnx.BatchNorm)]
    momentum = [norm.momentum for norm in norms]
    for norm in norms:
        norm.momentum = 0.0  # the running statistics become the batch's
    model.train()
    graphdef, state = nnx.split(model)

    @jax.jit
    def batch_statistics(state, images):
        model = nnx.merge(graphdef, state)
        model(images)
        return nnx.state(model, nnx.BatchStat)

    found = []
    for step, (images, _) in enumerate(data):
        if step == batches_used:
            break
        # one batch at a time: these programs share no data, so without the wait XLA may run several at once on the
        # CPU devices; with 16 in flight, one all-reduce waited for a device that never joined it (once, in the Keras
        # notebook's test on 2 devices) and XLA ended the process after 40 s
        found.append(jax.block_until_ready(batch_statistics(state, jax.device_put(images, sharding))))
    for norm, kept in zip(norms, momentum, strict=True):
        norm.momentum = kept
    nnx.update(model, jax.tree.map(lambda *each: sum(each) / len(each), *found))


def weights_fingerprint(state) -> str:
    """:func:`common.run.protocol.fingerprint` of every array of ``state`` (an ``nnx.state``: weights, BatchNorm
    statistics, the optimizer's state), by path."""
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    return protocol.fingerprint((jax.tree_util.keystr(path), np.asarray(leaf)) for path, leaf in leaves)


def fsdp_spec(shape: tuple[int, ...], devices: int) -> P:
    """Where fully sharded data parallelism puts an array of ``shape`` on a mesh axis "data" of ``devices``: its
    largest axis that divides evenly, split across the devices; replicated (``P()``) if none does."""
    spec = [None] * len(shape)
    for axis in np.argsort(shape, kind="stable")[::-1]:
        if shape[axis] % devices == 0:
            spec[axis] = "data"
            return P(*spec)
    return P()


def bytes_per_device(tree) -> dict[str, int]:
    """How many bytes of ``tree``'s arrays each device holds: ``{device: bytes}``."""
    held: dict[str, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            held[str(shard.device)] = held.get(str(shard.device), 0) + shard.data.nbytes
    return held


def random_batch(global_batch: int, image_size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """One random batch shaped as the training batches (uint8 gray images, float32 labels), on the host."""
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (global_batch, image_size, image_size), dtype=np.uint8)
    return images, rng.integers(0, 2, (global_batch, NUM_CLASSES)).astype(np.float32)


def synthetic_batch(global_batch: int, image_size: int, sharding, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    """:func:`random_batch`, sharded over the devices: the in-RAM benchmark's input."""
    return tuple(jax.device_put(array, sharding) for array in random_batch(global_batch, image_size, seed))


def time_steps(train_step, global_batch: int, image_size: int, steps: int, sharding, phases=None) -> float:
    """Images per second of ``steps`` calls of ``train_step(images, labels)`` on one random batch already on the
    devices (no decoding, no copies from the host), after two untimed warm-up steps."""
    images, labels = synthetic_batch(global_batch, image_size, sharding)
    seconds = timed_steps(lambda: train_step(images, labels), steps, jax.block_until_ready, phases)
    return steps * global_batch / seconds


def save_checkpoint(folder, epoch: int, settings: dict, history: dict, state) -> None:
    """``state`` (an ``nnx.state`` of the model and optimizer: weights, statistics, Adam's moments and its step count,
    so the schedule) as an Orbax checkpoint folder, written under a temporary name and renamed."""

    def write(path: Path) -> None:
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(path.absolute(), state)
            checkpointer.wait_until_finished()

    checkpoints.save(folder, epoch, ".orbax", write, settings, history)


def load_checkpoint(checkpoint: checkpoints.Checkpoint, state) -> tuple:
    """The state saved in ``checkpoint``, placed as ``state`` is (its shapes, dtypes and shardings), the epochs
    finished and the history."""
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(checkpoint.state.absolute(), state)
    return restored, checkpoint.epoch, checkpoint.history


def step_difference(before, state, other) -> dict[str, float]:
    """How far apart two states are that took one step from ``before`` on the same batch, each as a share of the
    largest value it could differ in: the ``gradients`` they stepped with, read off Adam's first moments (a step
    moves them by ``1 - b1`` times its gradient), and their BatchNorm running ``statistics``."""

    def moments(tree):
        return jax.tree.leaves(tree[1]["opt_state"][0]["mu"])

    def statistics(tree):
        return jax.tree.leaves(nnx.filter_state(tree, nnx.BatchStat))

    def largest(arrays) -> float:
        return max(float(jnp.max(jnp.abs(array))) for array in arrays)

    gradients = [(a - ADAM_B1 * b) / (1 - ADAM_B1) for a, b in zip(moments(state), moments(before), strict=True)]
    apart = [(a - b) / (1 - ADAM_B1) for a, b in zip(moments(state), moments(other), strict=True)]
    stats_apart = [a - b for a, b in zip(statistics(state), statistics(other), strict=True)]
    return {
        "gradients": largest(apart) / largest(gradients),
        "statistics": largest(stats_apart) / largest(statistics(state)),
    }


def check_parallelism(name: str) -> str:
    return params.check_choice("PARALLELISM", name, PARALLELISMS)


def check_pretrained(pretrained: bool) -> None:
    params.check_not_pretrained(
        pretrained, "there are no ImageNet DenseNet-121 weights for Flax (its examples have no DenseNet)"
    )
