"""The TensorFlow pieces both TensorFlow notebooks are built from, and tf.distribute's data-parallel sync."""

import builtins
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import keras
import numpy as np
import pytest
import tensorflow as tf
from IPython.core.events import EventManager, available_events
from IPython.core.interactiveshell import ExecutionResult
from png_modes import HEIGHT, MODES, WIDTH, write

from common.data import chestxray
from common.errors import InputError
from common.keras import callbacks as kc
from common.keras import model as km
from common.measure.phases import Phases
from common.run import checkpoints, devices, params, protocol
from common.tensorflow import imports as tf_import
from common.tensorflow import speedups as ks
from common.tensorflow import utils as tfu


@pytest.mark.parametrize("mode", MODES)
def test_the_pipeline_reads_every_png_mode_as_the_shared_pixels(tmp_path, mode):
    path, expected = write(tmp_path, mode)
    keys, read = tfu._images(chestxray.Split([path], np.zeros((1, 14)), np.zeros(1)))
    image = read(tf.constant(keys[0])).numpy()
    assert image.dtype == np.uint8 and image.shape == (HEIGHT, WIDTH, 1)
    np.testing.assert_array_equal(image[..., 0], expected)


def test_gpus_this_tensorflow_cannot_use_stop_the_notebook_before_tensorflow_starts(monkeypatch):
    """tensorflow-cpu (or CUDA libraries TensorFlow cannot load) on a GPU box: a stop naming it, not a CPU run."""
    gpus = devices.Devices("gpu", 2, 2, ("NVIDIA L40S",) * 2, 45.0, (8, 9))
    monkeypatch.setattr(devices, "driver_version", lambda: "580.95.05")
    with pytest.raises(InputError, match=r"NVIDIA L40S.*TensorFlow .*a build without CUDA.*can use 0 of the 2"):
        tfu.configure_devices(gpus, "mirrored")
    assert not tf.config.get_visible_devices("GPU"), "the check changed nothing in TensorFlow's configuration"


GPUS = [tf.config.PhysicalDevice(f"/physical_device:GPU:{index}", "GPU") for index in range(3)]


def gpu_box(count: int) -> devices.Devices:
    return devices.Devices("gpu", count, len(GPUS), ("NVIDIA L40S",) * count, 45.0, (8, 9))


@pytest.mark.parametrize(
    "configure, used",
    [
        (lambda: tfu.configure_devices(gpu_box(2), "mirrored"), 2),
        (lambda: tfu.configure_devices(gpu_box(2), "multi_worker"), 2),
        (lambda: ks.use_one_device("gpu"), 1),  # Keras_Speedups
    ],
    ids=["mirrored", "multi_worker", "speedups"],
)
def test_every_gpu_tensorflow_uses_grows_its_memory_as_needed(monkeypatch, configure, used):
    """Without memory growth TensorFlow's allocator takes nearly all of a GPU's memory when it starts, and keeps it
    until the process ends: the next notebook's launch would find none. It is set before the runtime starts (which
    refuses it later), on each GPU made visible, for every way a TensorFlow notebook sets up its devices."""
    listed = tf.config.list_physical_devices
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind=None: GPUS if kind == "GPU" else listed(kind))
    monkeypatch.setattr(tfu, "require_usable_gpus", lambda hardware: None)  # tensorflow-cpu here
    monkeypatch.setattr(devices, "resolve", lambda requested: gpu_box(requested))
    calls = []
    monkeypatch.setattr(tf.config, "set_visible_devices", lambda found, kind: calls.append(("visible", found, kind)))
    monkeypatch.setattr(tf.config.experimental, "set_memory_growth", lambda gpu, on: calls.append(("growth", gpu, on)))
    # and GPUs keep Grappler's graph passes, which CPU devices go without
    monkeypatch.setattr(tf.config.optimizer, "set_experimental_options", lambda options: calls.append(("grappler",)))
    configure()
    assert calls == [("visible", GPUS[:used], "GPU"), *(("growth", gpu, True) for gpu in GPUS[:used])]


def test_densenet121_has_the_shared_parameter_count():
    """The same 6,968,206 trainable parameters as torchvision's DenseNet-121 with 14 outputs."""
    assert km.trainable_parameters(km.build_densenet121(32)) == 6_968_206


def test_densenet121_matches_torchvision_batch_norm_momentum_and_float32_head():
    model = km.build_densenet121(32, activation="sigmoid")
    norms = [layer for layer in model.layers if layer.__class__.__name__ == "BatchNormalization"]
    assert len(norms) == 121 and {layer.momentum for layer in norms} == {params.BATCH_NORM_MOMENTUM}
    assert model.layers[-1].dtype_policy.compute_dtype == "float32"
    scores = model(np.zeros((2, 32, 32, 1), np.uint8)).numpy()
    assert scores.shape == (2, 14) and ((scores > 0) & (scores < 1)).all()


@pytest.fixture(scope="module")
def splits(standin):
    return chestxray.load(standin, seed=0)


def test_datasets_give_uint8_gray_images_and_score_every_image_once(splits):
    """1 byte per pixel crosses to the devices, not the 12 of three float32 channels: the model normalizes."""
    train = tfu.dataset(splits["train"], 24, global_batch=8, training=True)
    assert train.element_spec == (tf.TensorSpec((8, 24, 24, 1), tf.uint8), tf.TensorSpec((8, 14), tf.float32))
    images, _ = next(iter(train))
    assert float(tf.math.reduce_std(tf.cast(images, tf.float32))) > 1
    assert sum(int(batch[1].shape[0]) for batch in train) == len(splits["train"]) // 8 * 8  # full batches only
    test = [labels.numpy() for _, labels in tfu.dataset(splits["test"], 24, global_batch=7, training=False)]
    np.testing.assert_array_equal(np.concatenate(test), splits["test"].labels)  # all, in order
    first = next(iter(tfu.dataset(splits["test"], 24, 7, training=False)))[0]
    again = next(iter(tfu.dataset(splits["test"], 24, 7, training=False)))[0]
    np.testing.assert_array_equal(first.numpy(), again.numpy())  # evaluation is deterministic


def test_the_model_takes_what_the_datasets_and_the_benchmark_give(splits):
    """Training, evaluation and the synthetic-data benchmark feed the same model: the same images' dtype and shape."""
    model = km.build_densenet121(32)
    train = tfu.dataset(splits["train"], 32, global_batch=8, training=True)
    test = tfu.dataset(splits["test"], 32, global_batch=8, training=False)
    random = tfu.random_batch(8, 32)
    assert tuple(tf.TensorSpec.from_tensor(part) for part in random) == train.element_spec
    assert float(tf.math.reduce_std(tf.cast(random[0], tf.float32))) > 50  # spread over the 256 levels
    assert model.input.dtype == "uint8" and tuple(model.input.shape) == (None, 32, 32, 1)
    assert test.element_spec[0].is_compatible_with(tf.TensorSpec(model.input.shape, model.input.dtype))


def test_the_model_normalizes_uint8_gray_into_the_three_channels_the_pipeline_gave_before():
    """On the devices now, the ImageNet normalization of the gray repeated into 3 channels, as Pillow's pipeline
    (Gluon, Chainer) and torchvision's compute it on the host, to float32 rounding."""
    pixels = np.random.default_rng(0).integers(0, 256, (2, 5, 7, 1), dtype=np.uint8)
    mean, std = np.float32(params.IMAGENET_MEAN), np.float32(params.IMAGENET_STD)
    expected = (np.repeat(pixels, 3, axis=-1).astype(np.float32) / 255 - mean) / std
    normalized = km.GrayToImageNet()(pixels)
    assert normalized.dtype == tf.float32
    np.testing.assert_allclose(normalized.numpy(), expected, rtol=0, atol=1e-6)
    # under a mixed-precision policy: normalized in float32, then rounded once to the compute dtype
    half = km.GrayToImageNet(dtype="mixed_bfloat16")(pixels)
    assert half.dtype == tf.bfloat16
    np.testing.assert_array_equal(half.numpy(), tf.cast(expected, tf.bfloat16).numpy())
    assert not km.GrayToImageNet().weights


@pytest.mark.parametrize("shape", [(40, 36, 1), (100, 90, 1)], ids=["prepared, no antialias", "PNG, antialiased"])
def test_resized_images_are_rounded_to_uint8(shape):
    """tf.image.resize gives floats: rounded, as torchvision and Pillow round their uint8 resizes (a plain cast would
    truncate: half a level darker on average)."""
    image = tf.constant(np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8))
    resized = tfu._resize(image, (24, 24))
    exact = tf.image.resize(image, (24, 24), antialias=shape[0] > 36).numpy()
    assert resized.dtype == tf.uint8 and resized.shape == (24, 24, 1)
    assert np.abs(resized.numpy() - exact).max() <= 0.5


@pytest.mark.parametrize("steps", [3, 30])
def test_the_optimizer_follows_the_projects_schedule(steps):
    """Keras' ``CosineDecay`` with a warmup gives every step the rate of :func:`params.schedule_factor` (without a
    warmup in a run of five steps or fewer)."""
    optimizer = tfu.make_optimizer(1e-3, steps=steps)
    rates = []
    for step in range(steps + 1):
        optimizer.iterations.assign(step)
        rates.append(float(optimizer.learning_rate))
    np.testing.assert_allclose(
        rates, [1e-3 * params.schedule_factor(step, steps) for step in range(steps + 1)], atol=1e-9
    )


def test_the_devices_datasets_of_a_distributed_dataset_do_not_autotune_the_source_does():
    """Each device's own dataset, inside the distributed iterator, without the autotune thread whose teardown stalled
    Keras' fit; the notebook's dataset, the source, keeps its autotuning."""
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    source = tf.data.Dataset.range(8).batch(2)
    iterator = iter(strategy.experimental_distribute_dataset(source))
    device_iterators = iterator._iterators[0]._iterator._device_iterators
    assert [each._dataset.options().autotune.enabled for each in device_iterators] == [False]
    assert source.options().autotune.enabled is not False
    assert [int(x) for x in next(iterator)] == [0, 1]


def test_training_augmentation_depends_on_the_seed_only_and_changes_every_epoch(splits):
    def first_batch(data):
        return next(iter(data))[0].numpy()

    data = tfu.dataset(splits["train"], 24, global_batch=8, training=True, seed=3)
    again = tfu.dataset(splits["train"], 24, global_batch=8, training=True, seed=3)
    np.testing.assert_array_equal(first_batch(data), first_batch(again))
    assert not np.array_equal(first_batch(data), first_batch(data))  # the next epoch: a new shuffle and new crops
    other = tfu.dataset(splits["train"], 24, global_batch=8, training=True, seed=4)
    assert not np.array_equal(first_batch(again), first_batch(other))


def test_replica_loss_is_the_mean_over_the_global_batch():
    labels = tf.constant([[1.0] * 14, [0.0] * 14])
    logits = tf.zeros((2, 14))
    np.testing.assert_allclose(float(tfu.replica_loss(labels, logits, global_batch=2)), np.log(2), rtol=1e-6)
    np.testing.assert_allclose(float(tfu.replica_loss(labels, logits, global_batch=4)), np.log(2) / 2, rtol=1e-6)


def test_recomputed_batch_norm_statistics_are_the_mean_of_the_batches_and_momentum_is_restored():
    norm = keras.layers.BatchNormalization(momentum=0.9)
    model = keras.Sequential([keras.Input((3,)), norm])
    batches = [np.full((4, 3), 2.0, np.float32), np.full((4, 3), 6.0, np.float32), np.zeros((4, 3), np.float32)]
    data = tf.data.Dataset.from_tensor_slices((np.concatenate(batches), np.zeros(12, np.float32))).batch(4)
    tfu.recompute_batch_norm_statistics(model, data, batches=2)  # the first two batches only
    np.testing.assert_allclose(norm.moving_mean.numpy(), [4.0] * 3)
    assert norm.momentum == 0.9


@pytest.mark.parametrize("strategy", ["central", "", "multi-worker"])
def test_unknown_strategy_is_refused(strategy):
    with pytest.raises(InputError, match="STRATEGY must be one of"):
        tfu.check_strategy(strategy)


def test_keras_refuses_multi_worker_naming_the_upstream_issue():
    assert tfu.check_keras_strategy("mirrored") == "mirrored"
    with pytest.raises(InputError, match="keras-team/keras#20585"):
        tfu.check_keras_strategy("multi_worker")


def test_step_timer_leaves_out_the_warm_up_steps_and_records_both_as_phases():
    phases = Phases()
    timer = kc.StepTimer(global_batch=10, warmup=2, phases=phases)
    timer._times = [0.0, 4.0, 5.0, 6.0, 7.0, 8.0]  # the start, a slow first step (tracing), then one per second
    timer.on_train_end()
    assert timer.images_per_second == pytest.approx(10.0)
    assert [(row["phase"], row["seconds"]) for row in phases.rows()] == [("benchmark warm-up", 5.0), ("benchmark", 3.0)]


def test_mixed_precision_is_bf16_on_cpu_with_a_float32_head():
    try:
        assert tfu.set_precision("mixed", "cpu") == "mixed_bfloat16"
        model = km.build_densenet121(32)
        assert model.get_layer("conv1_conv").compute_dtype == "bfloat16"
        assert model.get_layer("gray_to_imagenet").compute_dtype == "bfloat16"
        assert model(np.zeros((1, 32, 32, 1), np.uint8)).dtype == "float32"
        assert not isinstance(tfu.make_optimizer(1e-3, 10, "mixed_bfloat16"), keras.optimizers.LossScaleOptimizer)
        assert isinstance(tfu.make_optimizer(1e-3, 10, "mixed_float16"), keras.optimizers.LossScaleOptimizer)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert tfu.set_precision("fp32", "cpu") == "float32"


@pytest.fixture(scope="module")
def replicas():
    """One SGD step on 1 and on 2 logical CPU devices, in a process of its own (see tf_replicas.py)."""
    script = Path(__file__).with_name("tf_replicas.py")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("strategy", ["mirrored", "central_storage"])
def test_two_replicas_take_the_same_step_as_one_device(replicas, strategy):
    result = replicas[strategy]
    assert result["replicas"] == 2
    assert result["two_vs_one"] < 1e-6
    assert result["step_size"] > 1e-3  # the step really moved the weights, so equality is not trivial
    # the check is sharp: dividing each replica's loss by its own share of the batch doubles the step
    assert result["wrong_reduction_vs_one"] > result["step_size"] / 2
    # model.fit reduces the loss the same way: the Keras notebook takes the same step as the custom loop
    assert result["fit_two_vs_one"] < 1e-6 and result["fit_vs_custom_loop"] < 1e-6


def test_the_fused_adam_takes_keras_adams_steps_on_every_replica(replicas):
    """tfu.Adam (one ResourceApplyAdam per variable): the weights and slots of Keras' Adam after 3 steps on 2
    replicas, every replica's copies equal, the same as on one device and with the variables stored once."""
    result = replicas["adam"]
    assert result["moved"] > 1e-2  # 3 steps at 0.01 moved the weights
    assert result["fused_vs_keras"] < 1e-6
    assert result["replicas_apart"] == 0.0
    assert result["two_vs_one"] < 1e-6 and result["central_storage_vs_mirrored"] < 1e-6


def test_cpu_devices_train_without_grapplers_passes(replicas):
    """make bench-first-step: on 2 CPU devices they cost about 8 s of DenseNet-121's first step."""
    assert replicas["grappler"].get("disable_meta_optimizer") is True


def test_multi_worker_without_tf_config_is_one_worker_taking_the_same_step(replicas):
    assert replicas["multi_worker"] == {"replicas": 1, "vs_one": pytest.approx(0.0, abs=1e-6)}


def test_batch_norm_statistics_stay_per_replica(replicas):
    """The known exception: each replica keeps the statistics of its own share of the batch."""
    result = replicas["batch_norm"]
    first, second = (np.array(mean) for mean in result["replica_moving_means"])
    assert not np.allclose(first, second, atol=1e-4)
    assert not np.allclose(first, result["one_device_moving_mean"], atol=1e-4)
    # what the notebooks do before evaluating, as DDP does: every replica gets the first one's statistics
    assert result["shared_moving_means"] == [result["replica_moving_means"][0]] * 2
    # recomputed outside the replicas, every replica gets the same, new statistics
    first, second = result["recomputed_moving_means"]
    assert first == second and not np.allclose(first, result["shared_moving_means"][0], atol=1e-4)


@pytest.mark.parametrize("replicas_used", ["1", "2"])
def test_training_benchmark_and_evaluation_reuse_their_traced_graphs(replicas, replicas_used):
    """Tracing DenseNet-121 takes tens of seconds on a CPU: the benchmark runs the training step's own graph, and
    evaluation traces full batches once and partial ones once, however many epochs and splits it scores."""
    result = replicas["tracings"][replicas_used]
    assert result["scored"] == [20, 20, 11], "every image scored once"
    assert result["train"] == 1, "the benchmark traced the training step again"
    assert result["predict"] <= 2, f"evaluation traced {result['predict']} graphs: one per epoch or split"
    assert result["benchmark_images_per_second"] > 0


def tiny_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])


def test_a_restored_custom_loop_checkpoint_continues_exactly_like_the_uninterrupted_run(tmp_path):
    data = np.random.default_rng(0).normal(size=(6, 8, 4)).astype(np.float32)

    def build():
        model = tiny_model()
        optimizer = tfu.make_optimizer(0.1, steps=6)
        optimizer.build(model.trainable_variables)
        return model, optimizer, tf.train.Checkpoint(model=model, optimizer=optimizer)

    def train(model, optimizer, steps):
        for batch in steps:
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(model(batch) ** 2)
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    model, optimizer, state = build()
    train(model, optimizer, data[:3])
    tfu.save_checkpoint(tmp_path, 3, {"EPOCHS": 6}, {"train_loss": [0.5]}, state)
    train(model, optimizer, data[3:])

    resumed_model, resumed_optimizer, resumed_state = build()
    assert tfu.load_checkpoint(checkpoints.complete(tmp_path)[-1], resumed_state) == (3, {"train_loss": [0.5]})
    assert int(resumed_optimizer.iterations) == 3  # the learning-rate schedule resumes at step 3
    train(resumed_model, resumed_optimizer, data[3:])
    for expected, found in zip(model.get_weights(), resumed_model.get_weights()):
        np.testing.assert_array_equal(found, expected)


class FixedAUC(keras.callbacks.Callback):
    history: list

    def on_epoch_end(self, epoch, logs=None):
        self.history.append(0.5)


def test_keras_epoch_checkpoints_resume_model_fit_exactly_and_keep_the_history(tmp_path):
    images = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    labels = np.zeros((16, 2), np.float32)

    def build():
        model = tiny_model()
        model.compile(optimizer=tfu.make_optimizer(0.1, steps=12), loss="mse")
        return model

    def fit(model, first, last, history, folder=None, phases=None):
        auc = FixedAUC()
        auc.history = []
        log = kc.EpochLog(phases or Phases(), auc, history, folder, {"EPOCHS": 3})
        model.fit(
            images,
            labels,
            batch_size=4,
            shuffle=False,
            epochs=last,
            initial_epoch=first,
            verbose=0,
            callbacks=[auc, log],
        )
        return log.history

    model, phases = build(), Phases()
    fit(model, 0, 2, protocol.new_history(16, 16), tmp_path, phases)
    resume = checkpoints.complete(tmp_path)[-1]
    fit(model, 2, 3, protocol.new_history(16, 16))
    # the first step traced the graph; each epoch trained, then validated (here: nothing to validate)
    assert [row["phase"] for row in phases.rows()][:3] == ["first steps", "train", "validate"]
    assert [row.get("epoch") for row in phases.rows() if row["phase"] == "train"] == [1, 2]

    resumed = build()
    epoch, history = kc.load_checkpoint(resume, resumed)
    assert epoch == 2 and len(history["train_loss"]) == 2
    history = fit(resumed, 2, 3, history, tmp_path)
    assert len(history["epoch_seconds"]) == len(history["train_loss"]) == len(history["valid_auc"]) == 3
    assert history["data_wait_seconds"] == [None] * 3  # model.fit reads its batches inside the traced step
    assert [checkpoint.epoch for checkpoint in checkpoints.complete(tmp_path)] == [2, 3]
    for expected, found in zip(model.get_weights(), resumed.get_weights()):
        np.testing.assert_array_equal(found, expected)


def test_a_saved_model_loads_with_its_normalization(tmp_path):
    """``model.save`` names the normalization by its registered class: ``load_model`` rebuilds it, no custom_objects."""
    model = keras.Sequential([keras.Input((4, 4, 1), dtype="uint8"), km.GrayToImageNet(), keras.layers.Dense(2)])
    model.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    pixels = np.arange(32, dtype=np.uint8).reshape(2, 4, 4, 1)
    np.testing.assert_array_equal(loaded(pixels).numpy(), model(pixels).numpy())


def test_checkpoints_of_a_multi_worker_run_are_refused():
    tfu.check_checkpointing("mirrored", "/tmp/checkpoints")
    tfu.check_checkpointing("multi_worker", None)
    with pytest.raises(InputError, match="CHECKPOINT_DIR with STRATEGY='multi_worker' is not supported"):
        tfu.check_checkpointing("multi_worker", "/tmp/checkpoints")


@pytest.mark.parametrize("workers", [0, 1, 2], ids=["one process", "one worker", "two workers"])
def test_a_worker_of_several_tells_the_others_when_the_stop_button_ends_a_cell(monkeypatch, workers):
    """The kernel lives on after the stop button: the other workers would wait for this one in their next all-reduce
    forever. Notebooks build their strategy themselves and hand it to prepare_strategy; make_strategy does the same."""
    shell = SimpleNamespace(events=EventManager(None, available_events))
    monkeypatch.setattr(builtins, "get_ipython", lambda: shell, raising=False)  # inside a kernel
    told, quieted = [], []
    monkeypatch.setattr(tfu, "stop_other_workers", told.append)
    monkeypatch.setattr(tfu, "quiet_first_graph_notices", lambda: quieted.append(True))
    cluster = tf.train.ClusterSpec({"worker": [f"localhost:{2222 + index}" for index in range(workers)]})
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(cluster, task_type="worker", task_id=workers - 1)
    # what MultiWorkerMirroredStrategy reads from TF_CONFIG, without joining a cluster; MirroredStrategy has none
    strategy = SimpleNamespace(cluster_resolver=resolver if workers else None)
    assert tfu.prepare_strategy(strategy) is strategy and quieted == [True]
    shell.events.trigger("post_run_cell", ExecutionResult(None))  # a cell that finished: nothing to tell
    assert told == []
    stopped = ExecutionResult(None)
    stopped.error_in_exec = KeyboardInterrupt()
    for _ in range(2):  # told once: the first stop leaves this worker out of the cluster
        shell.events.trigger("post_run_cell", stopped)
    assert told == (["worker 1"] if workers > 1 else [])


START_UP = """WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
I0000 00:00:1796413111.595998    6585 port.cc:153] oneDNN custom operations are on. You may see slightly different
I0000 00:00:1796421970.454390     928 cpu_feature_guard.cc:227] This TensorFlow binary is optimized to use available
To enable the following instructions: AVX2 AVX512F FMA, in other operations, rebuild TensorFlow.
E0000 00:00:1796413114.519532    6585 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error (303)
W0000 00:00:1796413114.519532    6585 some.cc:1] a warning
that goes on
"""


def test_start_up_notices_are_dropped_and_everything_else_kept():
    kept = tf_import.kept_lines("before\n" + START_UP, gpu_present=False)
    assert kept == ["before\n", START_UP.splitlines(keepends=True)[-2], "that goes on\n"]
    # on a GPU machine the cuInit failure is why TensorFlow sees no GPU
    assert any("cuInit" in line for line in tf_import.kept_lines(START_UP, gpu_present=True))


def test_a_first_graph_of_booleans_logs_no_onednn_notice_once_the_strategy_exists():
    """keras.metrics.AUC transposes booleans in a Keras notebook's first step; TensorFlow logs an E0000 notice then."""
    script = textwrap.dedent(
        """
        from common.run import devices
        from common.tensorflow import utils as tfu
        hardware = devices.resolve(1, gpus=[])
        tfu.make_strategy("mirrored", tfu.configure_devices(hardware, "mirrored"), "cpu")
        tf = tfu.tf
        tf.function(lambda b: tf.reduce_any(tf.transpose(b)))(tf.eye(3) > 0)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "DT_BOOL" not in out.stderr, out.stderr


def test_importing_tensorflow_shows_no_start_up_notices_but_passes_other_output_on():
    script = "import os; from common.tensorflow.imports import keras, tf; os.write(2, b'after the import\\n')"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "InitializeLog" not in out.stderr and "I0000" not in out.stderr, out.stderr
    assert "after the import" in out.stderr


@pytest.mark.skipif(not tf_import.X86, reason="oneDNN is turned on for x86 CPUs only")
@pytest.mark.parametrize(("setting", "enabled"), [(None, True), ("0", False)])
def test_onednn_kernels_are_on_for_every_x86_cpu_unless_turned_off(setting, enabled):
    """TensorFlow turns them on by itself only on CPUs with AVX-512 neural-network instructions."""
    script = (
        "from common.tensorflow.imports import tf\n"
        "from tensorflow.python.util import _pywrap_util_port\n"
        "print(_pywrap_util_port.IsMklEnabled())"
    )
    env = {name: value for name, value in os.environ.items() if name != "TF_ENABLE_ONEDNN_OPTS"}
    if setting is not None:
        env["TF_ENABLE_ONEDNN_OPTS"] = setting
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [str(enabled)]
