"""TensorFlow pieces shared by the TensorFlow (custom loop) and Keras (``model.fit``) notebooks.

Imported only by those notebooks (``import common`` does not import TensorFlow).
:func:`configure_devices` must run before anything else touches TensorFlow's devices:
TensorFlow fixes its logical devices and thread pools when its runtime first starts.
"""

from __future__ import annotations

import sys

import numpy as np

from common.errors import InputError
from common.keras import model as km
from common.measure.phases import timed_steps
from common.run import checkpoints, kernel, params, protocol
from common.run import devices as common_devices
from common.run.params import CROP_SCALE, NUM_CLASSES
from common.tensorflow.imports import keras, quiet_first_graph_notices, tf

STRATEGIES = ("mirrored", "central_storage", "multi_worker")


def check_strategy(name: str) -> str:
    return params.check_choice("STRATEGY", name, STRATEGIES)


def check_keras_strategy(name: str) -> str:
    """``model.fit`` works under every strategy here but ``multi_worker``: say so before any training."""
    if check_strategy(name) == "multi_worker":
        raise InputError(
            "STRATEGY='multi_worker' does not work with Keras 3 model.fit today (it fails with \"Attempt to convert "
            "a value (PerReplica...)\", keras-team/keras#20585): use 'mirrored' on one machine, or the custom "
            "training loop of Tensorflow_MultiGPU.ipynb for several machines."
        )
    return name


def require_usable_gpus(hardware: common_devices.Devices) -> None:
    """Stop, naming the fix, when NVML lists GPUs that this TensorFlow cannot use (a CUDA build the driver cannot
    run, tensorflow-cpu, or CUDA libraries it cannot load); listing them does not start TensorFlow's runtime."""
    usable = len(tf.config.list_physical_devices("GPU"))
    build = tf.sysconfig.get_build_info().get("cuda_version")
    common_devices.require_usable(hardware, f"TensorFlow {tf.__version__}", usable, build)


def configure_devices(hardware: common_devices.Devices, strategy: str = "mirrored") -> list[str]:
    """Make ``hardware`` what TensorFlow sees; return the device names a strategy should use.

    GPUs: only the first ``hardware.count`` are visible, each with memory growth so TensorFlow does
    not reserve all memory up front. CPU: the physical CPU is split into ``hardware.count`` logical
    devices, so ``MirroredStrategy`` runs its real multi-replica path, and Grappler's graph passes are off.
    """
    check_strategy(strategy)
    if strategy == "multi_worker" and hardware.kind == "cpu" and hardware.count > 1:
        raise InputError(
            f"DEVICES={hardware.count} with STRATEGY='multi_worker' on a CPU: a worker uses one CPU device, so "
            f"start {hardware.count} workers with TF_CONFIG (one process each, DEVICES=1), or use "
            f"STRATEGY='mirrored' for {hardware.count} devices in this process."
        )
    if hardware.kind == "gpu":
        require_usable_gpus(hardware)
    try:
        if hardware.kind == "gpu":
            gpus = tf.config.list_physical_devices("GPU")[: hardware.count]
            tf.config.set_visible_devices(gpus, "GPU")
            for gpu in gpus:
                tf.config.experimental.set_memory_growth(gpu, True)
            return [f"/gpu:{i}" for i in range(len(gpus))]
        # The same SEED gives the same run on a CPU, as in the PyTorch notebook; GPUs keep their fastest kernels.
        tf.config.experimental.enable_op_determinism()
        # Replicas share one intra-op pool of the process's cores, and the inter-op pool lets them
        # run at once: each replica's ops get a device's share of the cores.
        tf.config.threading.set_intra_op_parallelism_threads(common_devices.threads_per_device(hardware.count))
        tf.config.threading.set_inter_op_parallelism_threads(hardware.count)
        # Grappler's graph passes (layouts, fusions, constant folding) pay on GPUs; on CPU devices they cost seconds
        # of every traced graph's first run, more than the notebooks' tens of steps win back (make bench-first-step)
        tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * hardware.count)
    except RuntimeError as error:
        raise InputError(
            f"TensorFlow has already started its runtime in this process ({error}): restart the kernel and run "
            "the notebook from the top, so the devices are configured before anything else uses TensorFlow."
        ) from None
    return [f"/cpu:{i}" for i in range(hardware.count)]


def make_strategy(name: str, device_names: list[str], kind: str) -> tf.distribute.Strategy:
    """The ``tf.distribute`` strategy called ``name`` over ``device_names``, for tests and scripts: the notebooks
    spell these lines out, as TensorFlow's distributed-training guide writes them.

    ``mirrored``: a copy of the variables on every device, gradients all-reduced (NCCL on GPUs).
    ``central_storage``: the variables once, on the CPU; the computation replicated on every device.
    ``multi_worker``: mirrored across processes or machines described by ``TF_CONFIG``; without it,
    this process is the only worker (its GPUs, or one CPU device).
    """
    check_strategy(name)
    if name == "mirrored":
        # NCCL only exists between GPUs; logical CPU devices reduce through one device
        cross_device = tf.distribute.ReductionToOneDevice() if kind == "cpu" else None
        strategy = tf.distribute.MirroredStrategy(device_names, cross_device_ops=cross_device)
    elif name == "central_storage":
        strategy = tf.distribute.experimental.CentralStorageStrategy(device_names, parameter_device="/cpu:0")
    else:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    return prepare_strategy(strategy)


def prepare_strategy(strategy: tf.distribute.Strategy) -> tf.distribute.Strategy:
    """What a notebook does once it has built ``strategy``; returns it.

    A worker of several (``TF_CONFIG``) tells the others when the stop button ends one of its cells
    (:func:`stop_other_workers`), and the first graph's notices are caught (:func:`quiet_first_graph_notices`).
    """
    resolver = strategy.cluster_resolver  # None but for a multi-worker strategy
    workers = resolver.cluster_spec().as_dict().get("worker", []) if resolver is not None else []
    if len(workers) > 1:
        task = resolver.task_id
        kernel.on_interrupt(lambda: stop_other_workers(f"worker {task}"))
    quiet_first_graph_notices()
    return strategy


def stop_other_workers(name: str) -> None:
    """The stop button ended a cell of this worker's kernel, which lives on: the other workers would wait for it in
    their next all-reduce forever. TensorFlow's coordination service aborts their collectives with this message. (A
    worker whose process ends is noticed without help: the others stop on its missing heartbeats.)"""
    # no public API for it: MultiWorkerMirroredStrategy itself reports errors to the cluster this way
    from tensorflow.python.eager import context

    try:
        context.context().report_error_to_cluster(tf.errors.CANCELLED, f"{name} was interrupted (the stop button)")
        told = "told the other workers to stop"
    except Exception as error:  # noqa: BLE001 (the coordination service may be gone with a stopped worker)
        told = f"could not tell the other workers to stop ({type(error).__name__}: {error})"
    print(
        f"Interrupted: {name} {told}. To train again, restart this kernel (TensorFlow joins a cluster once per "
        "process) and start every worker anew.",
        file=sys.stderr,
    )


def check_checkpointing(strategy: str, checkpoint_dir) -> None:
    """Checkpoints are for one machine: in a multi-worker run every worker would have to save (the saves are
    collective operations), each into its own folder, and resume from its own; that is not built, so it is refused."""
    if check_strategy(strategy) == "multi_worker" and checkpoint_dir is not None:
        raise InputError(
            "CHECKPOINT_DIR with STRATEGY='multi_worker' is not supported: every worker would have to save and resume "
            "its own copy. Leave CHECKPOINT_DIR=None for a multi-worker run, or checkpoint a run on one machine."
        )


def worker_index(strategy: tf.distribute.Strategy) -> int:
    """This process's task index in a multi-worker cluster; 0 for the only process (no ``TF_CONFIG``)."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.cluster_spec().as_dict():
        return 0
    return int(resolver.task_id or 0)


def is_chief(strategy: tf.distribute.Strategy) -> bool:
    """Whether this process writes results: the ``chief`` task, else worker 0, else the only process.

    Under ``MultiWorkerMirroredStrategy`` every worker runs the whole notebook; if each wrote its record,
    one run would count once per worker.
    """
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.cluster_spec().as_dict():
        return True
    if resolver.task_type == "chief":
        return True
    return (
        resolver.task_type == "worker" and worker_index(strategy) == 0 and "chief" not in resolver.cluster_spec().jobs
    )


def weights_fingerprint(model: keras.Model) -> str:
    """:func:`common.run.protocol.fingerprint` of every weight (BatchNorm statistics included), by variable path."""
    return protocol.fingerprint((weight.path, weight.numpy()) for weight in model.weights)


def set_precision(precision: str, kind: str) -> str:
    """Set the Keras mixed-precision policy: bf16 on CPUs and on GPUs from Ampere on, fp16 before."""
    if precision == "fp32":
        policy = "float32"
    elif kind == "gpu" and not all(
        tf.config.experimental.get_device_details(gpu).get("compute_capability", (0, 0)) >= (8, 0)
        for gpu in tf.config.get_visible_devices("GPU")
    ):
        policy = "mixed_float16"  # no fast bf16 before Ampere; fp16 needs loss scaling (see make_optimizer)
    else:
        policy = "mixed_bfloat16"
    keras.mixed_precision.set_global_policy(policy)
    return policy


def recompute_batch_norm_statistics(model: keras.Model, data: tf.data.Dataset, batches: int) -> None:
    """Replace the BatchNorm running averages by the mean statistics of ``batches`` batches of ``data``.

    The same as PyTorch's ``torch.optim.swa_utils.update_bn``: a cumulative average instead of the
    moving one. Run it outside ``strategy.run`` so that every replica's copy gets the same values.
    One traced forward pass serves every batch (half the time of eager calls on a CPU): the layers'
    momentum becomes a variable that the graph reads, instead of a number traced into it.
    """
    norms = [layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)]
    momentum = [layer.momentum for layer in norms]
    weight_of_the_past = tf.Variable(0.0, trainable=False)

    @tf.function
    def forward(images):
        model(images, training=True)

    try:
        for layer in norms:
            layer.momentum = weight_of_the_past
        for seen, (images, _) in enumerate(data.take(batches)):
            weight_of_the_past.assign(seen / (seen + 1))  # the first batch replaces, later ones average in
            forward(images)
    finally:
        for layer, value in zip(norms, momentum):
            layer.momentum = value


def share_batch_norm_statistics(model: keras.Model) -> None:
    """Give every replica the first replica's BatchNorm running statistics, as PyTorch's DDP does.

    Under a ``tf.distribute`` strategy each replica updates its own copy of the running mean and
    variance from its own share of the batch, so the copies drift apart and an image's score would
    depend on the replica that scores it. DDP broadcasts rank 0's copy before every forward pass;
    calling this before each evaluation gives the same statistics to every replica.
    """
    for variable in model.non_trainable_variables:
        copies = getattr(variable.value, "values", ())
        for copy in copies[1:]:
            copy.assign(copies[0])


class ShareBatchNormStatistics(keras.callbacks.Callback):
    """:func:`share_batch_norm_statistics` before every evaluation and prediction of ``model.fit`` and friends."""

    def on_test_begin(self, logs=None):
        share_batch_norm_statistics(self.model)

    def on_predict_begin(self, logs=None):
        share_batch_norm_statistics(self.model)


class Adam(keras.optimizers.Adam):
    """Keras' Adam with each variable's update as one fused TensorFlow op, ``ResourceApplyAdam`` (the kernel that
    tf.keras' Adam ran): the same arithmetic (tests/tensorflow/test_tf_utils.py compares the two).

    Keras 3 writes the update as about twenty graph ops per variable, and ``MirroredStrategy`` traces it once per
    variable and replica: 728 times for DenseNet-121 on 2 replicas. One op instead, fed with the step's scalars (the
    learning rate, the betas' powers) made once per device rather than once per variable, cuts the first step's
    tracing and graph optimization (``make bench-first-step`` measures both); on a GPU it is one kernel launch per
    variable instead of about ten.
    """

    def _distributed_tf_update_step(self, distribution, grads_and_vars, learning_rate):
        scalars = {}  # (device, dtype) -> this step's scalars, made on the first of that device's variables

        def update(variable, gradient, learning_rate):  # this device's learning rate: the strategy unwraps args
            key = (variable.device, variable.dtype)
            if key not in scalars:
                scalars[key] = self._step_scalars(variable.dtype, learning_rate)
            return self._fused_update(gradient, variable, scalars[key])

        for gradient, variable in grads_and_vars:
            distribution.extended.update(variable, update, args=(gradient, learning_rate), group=False)

    def update_step(self, gradient, variable, learning_rate):
        return self._fused_update(gradient, variable, self._step_scalars(variable.dtype, learning_rate))

    def _step_scalars(self, dtype, learning_rate) -> dict[str, tf.Tensor]:
        step = tf.cast(self.iterations.value + 1, dtype)
        beta_1, beta_2 = tf.constant(self.beta_1, dtype), tf.constant(self.beta_2, dtype)
        return dict(
            beta1_power=tf.pow(beta_1, step),
            beta2_power=tf.pow(beta_2, step),
            lr=tf.cast(learning_rate, dtype),
            beta1=beta_1,
            beta2=beta_2,
            epsilon=tf.constant(self.epsilon, dtype),
        )

    def _fused_update(self, gradient, variable, scalars):
        if self.amsgrad or isinstance(gradient, tf.IndexedSlices):  # kernels of their own: Keras' ops instead
            return super().update_step(gradient, variable, scalars["lr"])
        index = self._get_variable_index(variable)
        tf.raw_ops.ResourceApplyAdam(
            var=variable.handle,
            m=self._momentums[index].value.handle,  # under a strategy's update: this device's copy
            v=self._velocities[index].value.handle,
            grad=tf.cast(gradient, variable.dtype),
            **scalars,
        )


def make_optimizer(learning_rate: float, steps: int, policy: str = "float32") -> keras.optimizers.Optimizer:
    """Adam (:class:`Adam`) on the schedule of every notebook over ``steps`` steps
    (:func:`common.run.params.schedule_factor`): up from 0 to ``learning_rate`` over the warmup, then down a cosine
    to 0.

    Under float16 it is wrapped in dynamic loss scaling, which bf16 and fp32 do not need
    (``model.compile`` wraps it by itself).
    """
    optimizer = Adam(km.schedule(learning_rate, steps))
    return keras.optimizers.LossScaleOptimizer(optimizer) if policy == "mixed_float16" else optimizer


def replica_loss(labels: tf.Tensor, logits: tf.Tensor, global_batch: int) -> tf.Tensor:
    """One replica's share of the mean binary cross-entropy over the global batch, as the TensorFlow notebook's
    ``train_step`` writes it out.

    The optimizer sums the replicas' gradients, so each replica divides its summed loss by the
    global batch, not by its own: with 2 replicas a per-replica mean would double every step.
    """
    per_image = tf.reduce_mean(
        tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=tf.cast(logits, tf.float32)), axis=-1
    )
    return tf.nn.compute_average_loss(per_image, global_batch_size=global_batch)


def _resize(image: tf.Tensor, size) -> tf.Tensor:
    """Bilinear resize, antialiased when it shrinks by more than 1.5: from a full-size image it must be, and from the
    prepared size (at most 8/7) antialiasing changes next to nothing and costs TensorFlow half its pipeline's time.

    ``tf.image.resize`` computes in float32; the result is rounded back to uint8, as torchvision and Pillow resize
    uint8 images in the other frameworks, and so that a batch crosses to the devices at 1 byte per pixel."""
    shrink = tf.reduce_max(tf.cast(tf.shape(image)[:2], tf.float32) / tf.cast(size, tf.float32))
    resized = tf.cond(
        shrink > 1.5,
        lambda: tf.image.resize(image, size, antialias=True),
        lambda: tf.image.resize(image, size, antialias=False),
    )
    return tf.cast(tf.round(resized), tf.uint8)  # bilinear weights are convex: the values stay within 0 to 255


def train_transform(image: tf.Tensor, image_size: int, seed: tf.Tensor) -> tf.Tensor:
    """Random resized crop (area in ``CROP_SCALE``, aspect 3/4 to 4/3) and horizontal flip of a uint8 gray image; the
    model normalizes it (:class:`common.keras.model.GrayToImageNet`).

    Stateless random ops drawn from ``seed`` (shape [2]): the same image with the same seed gets the
    same crop, whichever thread of the parallel pipeline happens to decode it.
    """
    crop_seed, flip_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
    begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
        tf.shape(image),
        bounding_boxes=tf.zeros([1, 0, 4]),
        seed=crop_seed,
        area_range=CROP_SCALE,
        aspect_ratio_range=(3 / 4, 4 / 3),
        max_attempts=10,
        use_image_if_no_bounding_boxes=True,
    )
    image = _resize(tf.slice(image, begin, size), (image_size, image_size))
    # tf.slice cannot tell that the crop keeps the one channel: the batches get the model's static input shape
    return tf.ensure_shape(
        tf.image.stateless_random_flip_left_right(image, seed=flip_seed), (image_size, image_size, 1)
    )


def eval_transform(image: tf.Tensor, image_size: int) -> tf.Tensor:
    """Resize the short side of a uint8 gray image to ``image_size``, center crop."""
    shape = tf.cast(tf.shape(image)[:2], tf.float32)
    scaled = tf.cast(tf.round(shape * image_size / tf.reduce_min(shape)), tf.int32)
    image = _resize(image, scaled)
    return tf.image.resize_with_crop_or_pad(image, image_size, image_size)


def _images(split) -> tuple[np.ndarray, callable]:
    """What each image of ``split`` is keyed by (its position), and the graph function that reads it as uint8 (height,
    width, 1) through the split's own :meth:`~common.data.chestxray.Split.pixels`: a memory-mapped row of the prepared
    copy, or its PNG decoded and shrunk by the rule every framework shares. numpy and Pillow release the GIL while they
    read and decode, so tf.data's parallel map runs several at once."""
    shape = [split.size, split.size] if split.size else [None, None]

    def read(position: tf.Tensor) -> tf.Tensor:
        pixels = tf.numpy_function(lambda p: split.pixels(int(p)), [position], tf.uint8, stateful=False)
        return tf.ensure_shape(pixels, shape)[..., None]

    return np.arange(len(split)), read


def training_items(split, image_size: int, seed: int = 0):
    """The training split before :func:`dataset`'s parallel ``map``, for ``Keras_Speedups``, whose page writes out the
    rest of the chain: ``((image key, label), augmentation seed)`` items, shuffled anew and with new seeds on every
    pass (the same for the same ``seed``), and the function that makes one of them ``(uint8 image, label)``: the image
    read (from the prepared copy, or its PNG decoded), randomly cropped and flipped (:func:`train_transform`)."""
    keys, read = _images(split)
    items = tf.data.Dataset.from_tensor_slices((keys, split.labels.astype(np.float32)))
    items = items.shuffle(len(split), seed=seed, reshuffle_each_iteration=True)
    seeds = tf.data.Dataset.random(seed=seed, rerandomize_each_iteration=True).batch(2)

    def read_and_augment(item, pair):
        return train_transform(read(item[0]), image_size, pair), item[1]

    return tf.data.Dataset.zip(items, seeds), read_and_augment


def dataset(split, image_size: int, global_batch: int, training: bool, seed: int = 0) -> tf.data.Dataset:
    """A ``tf.data`` pipeline over a :class:`common.data.chestxray.Split`, batched by the global batch: uint8 gray
    images (batch, size, size, 1) and float32 labels; the model normalizes the images on the devices.

    Images are read (from the prepared copy, or decoded from their PNGs) and augmented in parallel (AUTOTUNE picks
    the threads) and the next batches are prefetched while the devices compute; the order and the augmentation depend
    on ``seed`` only. Training drops the last partial batch so every step has the global batch; evaluation keeps it,
    so every image is scored exactly once.
    """
    if training:
        items, read_and_augment = training_items(split, image_size, seed)
        data = items.map(read_and_augment, tf.data.AUTOTUNE)
    else:
        keys, read = _images(split)
        data = tf.data.Dataset.from_tensor_slices((keys, split.labels.astype(np.float32)))
        data = data.map(lambda key, label: (eval_transform(read(key), image_size), label), tf.data.AUTOTUNE)
    data = data.batch(global_batch, drop_remainder=training)
    # AUTOTUNE: one batch, doubled only when the devices drain the buffer empty, within tf.data's RAM budget
    return data.prefetch(tf.data.AUTOTUNE).with_options(_sharded_by_data())


def _sharded_by_data() -> tf.data.Options:
    """Several workers (multi_worker) each take every n-th global batch, rather than every n-th file."""
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return options


def predict_all(distributed_predict_step, distributed) -> tuple[np.ndarray, np.ndarray]:
    """Labels and scores of every image of a distributed dataset, gathered from all replicas in order.

    ``distributed_predict_step(batch)`` runs the replicas' prediction and returns ``(labels, scores)`` gathered from
    all of them. Made once (a ``tf.function`` with ``reduce_retracing``), it is traced for the full batches and once
    more for the first partial one; every later epoch and split reuses those graphs.
    """
    gathered = [distributed_predict_step(batch) for batch in distributed]
    labels = np.concatenate([labels.numpy() for labels, _ in gathered])
    scores = np.concatenate([scores.numpy() for _, scores in gathered])
    return labels, scores.astype(np.float32)


def random_batch(batch: int, image_size: int, seed: int = 0) -> tuple[tf.Tensor, tf.Tensor]:
    """Random uint8 gray images and coin-flip labels, shaped as :func:`dataset` batches them: the synthetic-data
    benchmark's input."""
    generator = tf.random.Generator.from_seed(seed)
    images = tf.cast(generator.uniform((batch, image_size, image_size, 1), maxval=256, dtype=tf.int32), tf.uint8)
    labels = tf.cast(generator.uniform((batch, NUM_CLASSES)) < 0.5, tf.float32)
    return images, labels


def time_steps(
    strategy: tf.distribute.Strategy, distributed_step, batch_per_replica: int, image_size: int, steps: int, phases=None
) -> float:
    """Images per second of all replicas together: ``steps`` distributed training steps on one random batch held on
    each replica's device.

    ``distributed_step(batch)`` is the training loop's own step and returns the loss: with the training batches'
    shapes it runs the graph traced for training, so the benchmark traces nothing again. Two warm-up steps
    (allocation) are not timed; ``phases`` (a :class:`common.measure.phases.Phases`) gets them and the timed steps.
    """
    global_batch = random_batch(batch_per_replica * strategy.num_replicas_in_sync, image_size)
    # split and placed as the training batches are, so that the step sees the very same input structure
    repeated = tf.data.Dataset.from_tensors(global_batch).repeat().with_options(_sharded_by_data())
    batch = next(iter(strategy.experimental_distribute_dataset(repeated)))
    # reading a loss back waits for its step
    seconds = timed_steps(lambda: distributed_step(batch), steps, lambda loss: loss.numpy(), phases)
    return steps * batch_per_replica * strategy.num_replicas_in_sync / seconds


def save_checkpoint(folder, epoch: int, settings: dict, history: dict, state: tf.train.Checkpoint) -> None:
    """The custom loop's checkpoint: ``tf.train.Checkpoint`` writes an index and data files into one folder."""

    def write(path):
        path.mkdir()
        state.write(str(path / "state"))

    checkpoints.save(folder, epoch, ".tf", write, settings, history)


def load_checkpoint(checkpoint: checkpoints.Checkpoint, state: tf.train.Checkpoint) -> tuple[int, dict]:
    """Load what :func:`save_checkpoint` wrote into the same objects; returns the epochs finished and the history."""
    state.read(str(checkpoint.state / "state")).assert_existing_objects_matched()
    return checkpoint.epoch, checkpoint.history
