"""The JAX notebook's model and helpers, on 2 simulated CPU devices (conftest.py)."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from common.data import chestxray
from common.errors import InputError
from common.jax import densenet
from common.jax import utils as ju
from common.run import checkpoints, devices, params
from common.run.params import IMAGENET_MEAN, IMAGENET_STD

MESH = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,))
SLICES, WHOLE = NamedSharding(MESH, P("data")), NamedSharding(MESH, P())


def test_densenet121_has_the_parameters_of_every_framework():
    model = nnx.eval_shape(lambda: densenet.DenseNet121(nnx.Rngs(0)))  # shapes only: no weights drawn
    assert densenet.trainable_parameters(model) == 6_968_206


def test_gray_images_become_three_imagenet_normalized_channels():
    images = jnp.array([[[0, 255]]], jnp.uint8)
    out = densenet.gray_to_imagenet(images)
    assert out.shape == (1, 1, 2, 3) and out.dtype == jnp.float32
    np.testing.assert_allclose(out[0, 0, 1], (1 - np.array(IMAGENET_MEAN)) / np.array(IMAGENET_STD), rtol=1e-6)
    assert densenet.gray_to_imagenet(images, jnp.bfloat16).dtype == jnp.bfloat16


@pytest.mark.parametrize("steps", [4, 5, 6, 40])
def test_the_schedule_is_the_projects_warmup_and_cosine(steps):
    schedule = ju.schedule(2e-3, steps)
    for step in range(steps + 1):
        assert float(schedule(step)) == pytest.approx(2e-3 * params.schedule_factor(step, steps), abs=1e-9)


def test_precision_picks_the_compute_dtype():
    assert ju.compute_dtype("fp32") == jnp.float32 and ju.compute_dtype("mixed") == jnp.bfloat16
    with pytest.raises(InputError, match="PRECISION"):
        ju.compute_dtype("fp16")


def test_bad_parallelism_and_pretrained_are_refused():
    assert ju.check_parallelism("fsdp") == "fsdp"
    with pytest.raises(InputError, match="PARALLELISM must be one of 'data', 'fsdp'"):
        ju.check_parallelism("zero3")
    with pytest.raises(InputError, match="PRETRAINED=True"):
        ju.check_pretrained(True)


def test_gpus_this_jax_cannot_use_stop_the_notebook(monkeypatch):
    """The CPU jaxlib on a GPU box: a stop naming it and the fix, not a silent run on the CPU."""
    monkeypatch.setattr(devices, "driver_version", lambda: "580.95.05")
    gpus = devices.Devices("gpu", 2, 2, ("NVIDIA H100 80GB HBM3",) * 2, 80.0, (9, 0))
    with pytest.raises(InputError, match=r"NVIDIA H100.*JAX .*can use 0 of the 2.*make setup"):
        ju.configure_devices(gpus)


def split_of(images: int) -> chestxray.Split:
    rng = np.random.default_rng(0)
    split = chestxray.Split([f"{i}.png" for i in range(images)], rng.integers(0, 2, (images, 14)), np.arange(images))
    pixels = rng.integers(0, 256, (images, 40, 40), dtype=np.uint8)
    split.pixels = lambda index: pixels[index]
    return split


def test_training_batches_are_full_reordered_each_epoch_and_repeatable():
    split = split_of(10)
    first = list(ju.batches(split, 32, 4, training=True, seed=0, epoch=0))
    assert len(first) == 2 and all(images.shape == (4, 32, 32) and images.dtype == np.uint8 for images, _ in first)
    again = list(ju.batches(split, 32, 4, training=True, seed=0, epoch=0))
    np.testing.assert_array_equal(first[0][0], again[0][0])  # the same images, crops and flips for the same epoch
    second = list(ju.batches(split, 32, 4, training=True, seed=0, epoch=1))
    assert not np.array_equal(first[0][1], second[0][1])


def test_evaluation_batches_hold_every_image_once_in_order():
    split = split_of(10)
    found = list(ju.batches(split, 32, 4, training=False, seed=0))
    assert [len(labels) for _, labels in found] == [4, 4, 2]
    np.testing.assert_array_equal(np.concatenate([labels for _, labels in found]), split.labels.astype(np.float32))


def test_predictions_cover_a_partial_last_batch_without_its_padding():
    split = split_of(7)
    data = ju.batches(split, 32, 4, training=False, seed=0)
    shapes = set()

    def predict(images):
        shapes.add(images.shape)
        return images.mean(axis=(1, 2))

    labels, scores = ju.predict_all(predict, data, SLICES, 4)
    assert shapes == {(4, 32, 32)}, "one shape: one compiled step"
    assert labels.shape == (7, 14) and scores.shape == (7,)
    expected = [ju.image_transforms.transform(split.pixels(i), 32)[0].mean() for i in range(7)]
    np.testing.assert_allclose(scores, expected, rtol=1e-6)


def test_synchronized_batch_norm_in_shard_map_equals_the_global_batchs():
    """What makes the notebook's shard_map step equal its jit step: BatchNorm with axis_name normalizes each device's
    slice by the statistics of the whole batch, as jit's BatchNorm on the whole batch does, and updates the same
    running averages."""
    make = densenet.Layers(nnx.Rngs(0), jnp.float32, None)
    norm = make.norm(3)
    synced = nnx.merge(nnx.graphdef(densenet.Layers(nnx.Rngs(0), jnp.float32, "data").norm(3)), nnx.state(norm))
    x = jax.device_put(np.random.default_rng(0).normal(2.0, 3.0, (8, 5, 5, 3)).astype(np.float32), SLICES)

    @jax.jit
    def whole(state, x):
        model = nnx.merge(nnx.graphdef(norm), state)
        return model(x), nnx.state(model)

    @jax.jit
    @partial(jax.shard_map, mesh=MESH, in_specs=(P(), P("data")), out_specs=(P("data"), P()))
    def per_device(state, x):
        model = nnx.merge(nnx.graphdef(synced), state)
        return model(x), nnx.state(model)

    (y_whole, s_whole), (y_slices, s_slices) = whole(nnx.state(norm), x), per_device(nnx.state(norm), x)
    np.testing.assert_allclose(y_slices, y_whole, atol=1e-5)
    np.testing.assert_allclose(s_slices["mean"][...], s_whole["mean"][...], atol=1e-6)
    np.testing.assert_allclose(s_slices["var"][...], s_whole["var"][...], atol=1e-5)
    assert not np.allclose(s_whole["mean"][...], 0)


class Tiny(nnx.Module):
    def __init__(self):
        self.norm = densenet.Layers(nnx.Rngs(0), jnp.float32, None).norm(2)

    def __call__(self, images):
        return self.norm(images[..., :2].astype(jnp.float32))


def test_precise_batch_norm_averages_the_statistics_of_the_batches():
    model = Tiny()
    batches = [(np.full((4, 3, 3, 3), value, np.uint8), None) for value in (10, 20, 60)]
    ju.recompute_batch_norm_statistics(model, iter(batches), 2, SLICES)
    np.testing.assert_allclose(model.norm.mean[...], [15, 15])  # the first two batches' mean, not a moving average
    assert model.norm.momentum == params.BATCH_NORM_MOMENTUM  # put back for training


def test_bytes_per_device_of_replicated_and_sharded_arrays():
    tree = {"w": jax.device_put(np.zeros((4, 6), np.float32), WHOLE)}
    assert list(ju.bytes_per_device(tree).values()) == [96, 96]  # a whole copy each
    sharded = {"w": jax.device_put(np.zeros((4, 6), np.float32), SLICES)}
    assert list(ju.bytes_per_device(sharded).values()) == [48, 48]  # half each


def model_and_optimizer():
    model = Tiny()
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def test_the_step_difference_reads_the_gradients_off_adams_moments():
    before = nnx.state(model_and_optimizer())

    def stepped(gradient: float):
        model, optimizer = model_and_optimizer()  # the same state as ``before``
        optimizer.update(model, jax.tree.map(lambda p: jnp.full_like(p, gradient), nnx.state(model, nnx.Param)))
        return nnx.state((model, optimizer))

    assert ju.step_difference(before, stepped(0.5), stepped(0.5)) == {"gradients": 0.0, "statistics": 0.0}
    assert ju.step_difference(before, stepped(0.5), stepped(0.4))["gradients"] == pytest.approx(0.2)


def test_the_fingerprint_tells_states_apart():
    model, optimizer = model_and_optimizer()
    state = jax.tree.map(lambda array: array.copy(), nnx.state((model, optimizer)))  # not a view of the model
    assert ju.weights_fingerprint(state) == ju.weights_fingerprint(nnx.state((model, optimizer)))
    optimizer.update(model, jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param)))
    assert ju.weights_fingerprint(nnx.state((model, optimizer))) != ju.weights_fingerprint(state)


def test_a_checkpoint_restores_the_state_where_it_was_placed(tmp_path):
    model, optimizer = model_and_optimizer()
    state = jax.device_put(nnx.state((model, optimizer)), WHOLE)
    optimizer.update(model, jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param)))
    trained = jax.device_put(nnx.state((model, optimizer)), WHOLE)
    ju.save_checkpoint(tmp_path, 3, {"SEED": 0}, {"train_loss": [1.0]}, trained)
    [written] = checkpoints.complete(tmp_path)
    assert written.state.name == "epoch-0003.orbax" and written.state.is_dir()
    restored, epoch, history = ju.load_checkpoint(written, state)
    assert epoch == 3 and history == {"train_loss": [1.0]}
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(trained), strict=True):
        np.testing.assert_array_equal(a, b)
        assert a.sharding == b.sharding


@pytest.mark.parametrize(
    ("shape", "devices", "spec"),
    [
        ((3, 3, 128, 32), 2, P(None, None, "data", None)),  # a convolution's kernel: its input channels
        ((1024, 14), 2, P("data", None)),
        ((14,), 2, P("data")),
        ((6, 4), 4, P(None, "data")),  # the largest axis does not divide: the next one
        ((7,), 2, P()),  # nothing divides: replicated
        ((), 2, P()),  # a step count
    ],
)
def test_fsdp_splits_the_largest_axis_that_divides_evenly(shape, devices, spec):
    assert ju.fsdp_spec(shape, devices) == spec


def test_sharded_densenet_state_is_half_per_device_on_two():
    """The notebook's PARALLELISM="fsdp" on 2 devices: every array of DenseNet-121 and Adam's state but the step counts
    has an axis that 2 divides, so each device holds half of what a replicated copy holds."""
    model = nnx.eval_shape(lambda: densenet.DenseNet121(nnx.Rngs(0)))  # shapes only
    state = nnx.state((model, nnx.eval_shape(lambda: nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param))))
    leaves = jax.tree.leaves(state)
    replicated = sum(np.prod(leaf.shape) * leaf.dtype.itemsize for leaf in leaves)
    sharded = sum(
        np.prod(NamedSharding(MESH, ju.fsdp_spec(leaf.shape, 2)).shard_shape(leaf.shape)) * leaf.dtype.itemsize
        for leaf in leaves
    )
    assert replicated / 2**20 == pytest.approx(80.1, abs=0.05)
    assert replicated / sharded == pytest.approx(2, rel=1e-6)


class Small(nnx.Module):
    def __init__(self):
        make = densenet.Layers(nnx.Rngs(0), jnp.float32, None)
        self.conv, self.norm = make.conv(3, 8, 3), make.norm(8)
        self.head = nnx.Linear(8, 14, rngs=nnx.Rngs(1))

    def __call__(self, images):
        x = nnx.relu(self.norm(self.conv(densenet.gray_to_imagenet(images))))
        return self.head(x.mean(axis=(1, 2)))


def test_a_step_with_sharded_state_equals_the_replicated_one():
    """The notebook's train_step, jitted with the state replicated and with it sharded: the same step."""
    model = Small()
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    graphdef, before = nnx.split((model, optimizer))
    rng = np.random.default_rng(0)
    images = jax.device_put(rng.integers(0, 256, (8, 16, 16), dtype=np.uint8), SLICES)
    labels = jax.device_put(rng.integers(0, 2, (8, 14)).astype(np.float32), SLICES)

    def step_with(sharding):
        @partial(jax.jit, in_shardings=(sharding, SLICES, SLICES), out_shardings=sharding)
        def train_step(state, images, labels):
            model, optimizer = nnx.merge(graphdef, state)
            grads = nnx.grad(lambda m: optax.sigmoid_binary_cross_entropy(m(images), labels).mean())(model)
            optimizer.update(model, grads)
            return nnx.state((model, optimizer))

        return train_step(jax.device_put(before, sharding), images, labels)

    whole = step_with(jax.tree.map(lambda _: WHOLE, before))
    sharded_sharding = jax.tree.map(lambda leaf: NamedSharding(MESH, ju.fsdp_spec(leaf.shape, 2)), before)
    sharded = step_with(sharded_sharding)
    kernel = sharded[0]["conv"]["kernel"][...]
    assert kernel.sharding.spec == P(None, None, None, "data")  # it stayed sharded: out_shardings
    assert max(ju.step_difference(before, whole, sharded).values()) < 1e-5
