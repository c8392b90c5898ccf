"""MXNet Gluon helpers for the Gluon notebook: contexts, the model, the input pipeline, evaluation.

Import this module after :func:`common.mxnet.imports.load` has imported MXNet with the thread count
that the notebook chose (importing this module first imports MXNet with its defaults).
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import re
import socket

import numpy as np

from common.data import image_transforms
from common.errors import InputError
from common.measure.phases import timed_steps
from common.mxnet import cluster as mxnet_cluster
from common.mxnet.imports import load
from common.run import checkpoints, devices, params, protocol
from common.run.params import IMAGENET_MEAN, IMAGENET_STD, NUM_CLASSES

mx = load()
from mxnet import autograd, gluon  # noqa: E402 (MXNet is imported through the helper above)
from mxnet.contrib import amp  # noqa: E402
from mxnet.gluon.model_zoo import vision  # noqa: E402

KVSTORES = ("local", "device", "nccl")
NO_KERNELS_FROM = (9, 0)  # the first compute capability MXNet's wheels have no kernels for
# MXNet's parameter server: a scheduler, servers that hold the weights and run the optimizer, workers that compute
DIST_KVSTORES = ("dist_sync", "dist_device_sync")


def check_gpus(hardware: devices.Devices) -> None:
    """A stop, naming the fix, on GPUs that this MXNet cannot use (too new for its kernels, or a build without CUDA),
    before the notebook makes ``mx.gpu(i)`` contexts that would fail at their first operation."""
    if hardware.kind == "gpu":
        check_compute_capability(hardware)
        devices.require_usable(hardware, f"MXNet {mx.__version__}", mx.context.num_gpus(), cuda_build())


def cuda_build() -> str | None:
    """The CUDA version of the installed MXNet package (``mxnet-cu112``: 11.2); None for the CPU-only ``mxnet``."""
    for dist in importlib.metadata.distributions():
        if match := re.fullmatch(r"mxnet-cu(\d+)(\d)", dist.metadata["Name"] or ""):
            return f"{match.group(1)}.{match.group(2)}"
    return None


def check_compute_capability(hardware: devices.Devices) -> None:
    """MXNet has no kernels for compute capability 9.0 or newer (H100, H200, Blackwell): refuse before any training.

    Every official MXNet 1.9.1 wheel is compiled for sm_50 to sm_86 without PTX, so on such a GPU the first
    operation fails ("no kernel image is available") after ``num_gpus()`` said yes. sm_86 code runs on every 8.x GPU.
    """
    capability = hardware.compute_capability
    if capability is None or capability < NO_KERNELS_FROM:
        return
    raise InputError(
        f"MXNet cannot run on {', '.join(sorted(set(hardware.names)))} (compute capability "
        f"{capability[0]}.{capability[1]}): no official MXNet 1.9.1 wheel has kernels for compute capability "
        f"{NO_KERNELS_FROM[0]}.{NO_KERNELS_FROM[1]} or newer (they stop at sm_86, with no PTX to compile from). "
        "GPUs up to 8.x (A100, L40, RTX 30 and 40) and CPU devices work: run this notebook on such a machine, or "
        "hide the GPUs (start the kernel with CUDA_VISIBLE_DEVICES= empty) to train on simulated CPU devices."
    )


def check_kvstore(kvstore: str | None, device_kind: str, checkpoint_dir=None) -> str:
    """``None`` picks ``device`` on GPUs (gradients summed on the GPUs) and ``local`` on CPUs.

    A ``dist_*`` kvstore needs this process to be a worker of a parameter-server cluster (``DMLC_*`` variables);
    its servers hold Adam's state, which ``trainer.save_states`` cannot save, so it refuses ``CHECKPOINT_DIR``.
    """
    if kvstore is None:
        return "device" if device_kind == "gpu" else "local"
    if kvstore not in KVSTORES + DIST_KVSTORES:
        raise InputError(f"KVSTORE must be one of {', '.join(KVSTORES + DIST_KVSTORES)} or None, not {kvstore!r}.")
    if kvstore in ("nccl", "dist_device_sync") and device_kind != "gpu":
        raise InputError(f"KVSTORE={kvstore!r} needs GPUs: use 'local' or None on a CPU ('dist_sync' across machines).")
    if kvstore in DIST_KVSTORES:
        if os.environ.get("DMLC_ROLE") != "worker":
            raise InputError(
                f"KVSTORE={kvstore!r} trains on a parameter-server cluster: start a scheduler and the servers "
                "(DMLC_ROLE=scheduler or server python -m common.mxnet.cluster), then this notebook with "
                "DMLC_ROLE=worker, all with DMLC_PS_ROOT_URI, DMLC_PS_ROOT_PORT, DMLC_NUM_SERVER and DMLC_NUM_WORKER "
                "set. The README's 'More than one machine' gives the commands; on one machine use KVSTORE=None."
            )
        if checkpoint_dir is not None:
            raise InputError(
                f"CHECKPOINT_DIR with KVSTORE={kvstore!r} is not supported: the servers hold the optimizer's state, "
                "which the workers cannot save. Leave CHECKPOINT_DIR=None, or checkpoint a run on one machine."
            )
    return kvstore


def create_kvstore(kvstore: str):
    """``(kvstore for the Trainer, this worker's rank, number of workers)``.

    The kvstores of one machine are left to the Trainer to create (``(kvstore, 0, 1)``). A ``dist_*`` kvstore is
    created here: creating it joins the cluster (it waits for every node), which tells the worker its rank. The worker
    also joins the scheduler's watch (:mod:`common.mxnet.cluster`): call ``mxnet_cluster.done()`` after its last use.
    """
    if kvstore not in DIST_KVSTORES:
        return kvstore, 0, 1
    mxnet_cluster.check_not_joined()
    kv = mx.kv.create(kvstore)
    mxnet_cluster.join(f"worker {kv.rank} on {socket.gethostname()}")  # stops the cluster if this worker leaves early
    # The Trainer starts by broadcasting every parameter onto itself (worker 0 pushes its weights, every worker pulls
    # into the same arrays). With MXNet 1.9.1's dist kvstore that aborted the server in our runs ("init <key> first",
    # every run with DenseNet-121); broadcasting from a copy never did.
    broadcast = kv.broadcast
    kv.broadcast = lambda key, value, out, priority=0: broadcast(key, value.copy(), out, priority=priority)
    return kv, kv.rank, kv.num_workers


def set_precision(precision: str, device_kind: str) -> str:
    """The compute dtype for ``PRECISION``; "mixed" turns on MXNet's AMP, which must precede building the model.

    fp16 on GPUs (MXNet 1.x has no bf16 on GPUs; fp16 needs loss scaling, see :func:`backward`),
    bf16 on CPUs (oneDNN kernels), as the PyTorch and TensorFlow notebooks do.
    """
    if precision == "fp32":
        return "float32"
    dtype = "float16" if device_kind == "gpu" else "bfloat16"
    amp.init(target_dtype=dtype)
    return dtype


def build_densenet121(ctx: list, pretrained: bool = False, classes: int = NUM_CLASSES) -> gluon.HybridBlock:
    """The model zoo's DenseNet-121 with a ``classes``-way output (6,968,206 parameters for 14), on ``ctx``.

    The zoo's model ends in a 7x7 average pool sized for 224-pixel images; a global average pool
    takes its place, so that any size from 32 pixels up works (at 224 the two are the same). New
    weights start as in torchvision: Kaiming-normal convolutions, a uniform classifier.
    """
    net = vision.densenet121(pretrained=pretrained)
    features = gluon.nn.HybridSequential(prefix=net.features.prefix)
    for layer in net.features:
        features.add(gluon.nn.GlobalAvgPool2D() if isinstance(layer, gluon.nn.AvgPool2D) else layer)
    net.features = features
    net.output = gluon.nn.Dense(classes, in_units=1024, prefix=net.output.prefix)
    if pretrained:
        net.features.collect_params().reset_ctx(ctx)
    else:
        net.features.initialize(mx.init.MSRAPrelu(factor_type="in", slope=0.0), ctx=ctx)
    net.output.initialize(mx.init.Uniform(1 / math.sqrt(1024)), ctx=ctx)
    net(mx.nd.zeros((1, 3, 32, 32), ctx=ctx[0]))  # the zoo defers the input channels: one pass settles the shapes
    return net


def warmup_cosine(learning_rate: float, steps: int) -> mx.lr_scheduler.CosineScheduler:
    """The rate of every notebook over ``steps`` updates (:func:`common.run.params.schedule_factor`): up from 0 to
    ``learning_rate`` over the warmup, then down a cosine to 0. MXNet numbers its updates from 1, so a Gluon run is one
    update ahead of the others: its first step is taken at 1/warmup of the peak, its last at 0."""
    return mx.lr_scheduler.CosineScheduler(steps, base_lr=learning_rate, warmup_steps=params.warmup_steps(steps))


def trainable_parameters(net: gluon.Block) -> int:
    """Parameters that receive gradients (BatchNorm running statistics do not)."""
    return sum(int(np.prod(p.shape)) for p in net.collect_params().values() if p.grad_req != "null")


def backward(losses: list, trainer: gluon.Trainer, dtype: str) -> None:
    """Back-propagate every device's loss at once; under fp16, through AMP's dynamic loss scaling."""
    if dtype == "float16":
        with amp.scale_loss(losses, trainer) as scaled:
            autograd.backward(scaled)
    else:
        autograd.backward(losses)


def normalize(images):
    """uint8 gray images (N, 1, H, W), as the loader delivers them, as the model's input: ImageNet-normalized float32
    (N, 3, H, W), computed where ``images`` are (after ``split_and_load``: on each context)."""
    x = images.astype("float32") / 255
    return mx.nd.concat(*[(x - mean) / std for mean, std in zip(IMAGENET_MEAN, IMAGENET_STD)], dim=1)


def _batch_norms(block: gluon.Block):
    for child in block._children.values():
        if isinstance(child, gluon.nn.BatchNorm):
            yield child
        yield from _batch_norms(child)


def share_batch_norm_statistics(net: gluon.Block, ctx: list) -> None:
    """Give every device the first device's BatchNorm running statistics, as PyTorch's DDP does.

    Each context keeps its own copy of the running mean and variance, updated from its own share
    of the batch; the trainer synchronizes only the trained weights. Without this an image's score
    would depend on the device that scores it.
    """
    for param in net.collect_params(".*running_mean|.*running_var").values():
        # copied array by array: Parameter.set_data would reset a trainer's kvstore, which a dist kvstore refuses
        for array in param.list_data()[1:]:
            param.data(ctx[0]).copyto(array)


def recompute_batch_norm_statistics(net: gluon.HybridBlock, data, batches: int, ctx: list) -> None:
    """ "Precise BN": the mean statistics of ``batches`` training batches replace the running averages.

    As ``torch.optim.swa_utils.update_bn`` under DDP: the first device computes them from its share of
    each batch, then every device gets a copy. The momentum is baked into a hybridized graph, so this
    runs imperatively and hybridizes the network again afterwards.
    """
    norms = list(_batch_norms(net))
    momentum = [norm._kwargs["momentum"] for norm in norms]
    net.hybridize(active=False)
    try:
        for seen, (images, _) in zip(range(batches), data):
            for norm in norms:
                norm._kwargs["momentum"] = seen / (seen + 1)  # the first batch replaces, later ones average in
            with autograd.record():
                output = net(normalize(gluon.utils.split_and_load(images, ctx, even_split=False)[0]))
            output.backward()  # MXNet updates the running statistics in the backward pass; no step follows
    finally:
        for norm, value in zip(norms, momentum):
            norm._kwargs["momentum"] = value
        net.hybridize(static_alloc=True)
    share_batch_norm_statistics(net, ctx)


def predict_all(net: gluon.Block, data, ctx: list) -> tuple[np.ndarray, np.ndarray]:
    """Labels and sigmoid scores of every image of ``data``, each batch split over all devices, in order."""
    labels, scores = [], []
    for images, targets in data:
        used = ctx[: len(images)]  # a last batch smaller than the device count leaves some idle
        parts = gluon.utils.split_and_load(images, used, even_split=False)
        scores.append(
            mx.nd.concat(*[net(normalize(x)).astype("float32").sigmoid().as_in_context(mx.cpu()) for x in parts], dim=0)
        )
        labels.append(targets)
    return mx.nd.concat(*labels, dim=0).asnumpy(), mx.nd.concat(*scores, dim=0).asnumpy()


def weights_fingerprint(net: gluon.Block) -> str:
    """:func:`common.run.protocol.fingerprint` of every parameter (BatchNorm statistics included) on the first
    context."""
    return protocol.fingerprint((name, param.data().asnumpy()) for name, param in sorted(net.collect_params().items()))


def time_steps(
    train_step, ctx: list, global_batch: int, image_size: int, steps: int, workers: int = 1, phases=None
) -> float:
    """Images per second of all workers together: ``steps`` calls of ``train_step(images, labels)`` on one fixed
    random batch, this worker's ``global_batch // workers`` images (the workers' steps are synchronized).

    The batch is uint8 gray, as the loader sends it, split over the contexts ``ctx`` once, before the steps:
    ``images`` and ``labels`` are the lists of every context's share, already there, so that the steps time the
    devices' work (normalization included, as in training) without the copies from the host, as the other notebooks'
    in-RAM figures do. Two warm-up steps are not timed (graph building, memory allocation); ``phases`` (a
    :class:`common.measure.phases.Phases`) gets them and the timed steps.
    """
    batch_size = global_batch // workers
    batch = (
        mx.nd.random.randint(0, 256, shape=(batch_size, 1, image_size, image_size)).astype("uint8"),
        mx.nd.random.randint(0, 2, shape=(batch_size, NUM_CLASSES)).astype("float32"),
    )
    images, labels = (gluon.utils.split_and_load(array, ctx) for array in batch)
    seconds = timed_steps(lambda: train_step(images, labels), steps, lambda _: mx.nd.waitall(), phases)
    return steps * global_batch / seconds


class ChestXrayDataset(gluon.data.Dataset):
    """One image of a :class:`common.data.chestxray.Split` (the prepared copy's row, or its PNG), augmented by
    :mod:`common.data.image_transforms`; items are (uint8 gray image (1, size, size), labels): :func:`normalize`
    makes the model's input on the devices.

    Training items are keyed ``epoch * len(self) + index`` by :class:`EpochBatchSampler`: the augmentation
    is drawn from ``(seed, epoch, index)``, so the same ``SEED`` gives the same images whichever decode
    process handles them.
    """

    def __init__(self, split, image_size: int, training: bool, seed: int = 0):
        self.split, self.labels = split, split.labels.astype(np.float32)
        self.image_size, self.training, self.seed = image_size, training, seed

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, key: int):
        epoch, index = divmod(int(key), len(self))
        augment = (self.seed, epoch, index) if self.training else None
        return image_transforms.transform(self.split.pixels(index), self.image_size, augment), self.labels[index]


class EpochBatchSampler:
    """Shuffled batches of dataset keys, a new order each epoch; the keys carry the epoch (see the dataset).

    ``part=(index, parts)`` yields only part ``index`` of ``parts`` equal parts of every batch: each worker of a
    multi-machine run reads its own share of the same global batches.
    """

    def __init__(self, length: int, batch_size: int, seed: int = 0, part: tuple[int, int] = (0, 1)):
        self.length, self.batch_size, self.seed, self.epoch = length, batch_size, seed, 0
        self.part = part

    def __len__(self) -> int:
        return self.length // self.batch_size  # the last partial batch is dropped: every step has the global batch

    def __iter__(self):
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.length) + self.epoch * self.length
        self.epoch += 1
        index, parts = self.part
        for step in range(len(self)):
            batch = order[step * self.batch_size : (step + 1) * self.batch_size]
            yield np.array_split(batch, parts)[index].tolist()


def loader(
    split,
    image_size: int,
    batch_size: int,
    training: bool,
    workers: int,
    seed: int = 0,
    part: tuple[int, int] = (0, 1),
    processes: bool = True,
    pin_memory: bool = False,
):
    """A Gluon ``DataLoader`` over a :class:`common.data.chestxray.Split` that decodes in ``workers`` processes.

    Training batches have the global batch, or its part ``part`` (see :class:`EpochBatchSampler`); the training
    step splits them over the devices. Evaluation keeps every image exactly once, in order. ``processes=False``
    decodes in threads instead: a worker of a parameter-server cluster must not fork its network connections.
    ``pin_memory=True`` (on GPUs) copies each batch into page-locked memory, from which the GPUs copy it by DMA.
    """
    data = ChestXrayDataset(split, image_size, training, seed)
    if training:
        batching = dict(batch_sampler=EpochBatchSampler(len(data), batch_size, seed, part))
    else:
        batching = dict(batch_size=batch_size, shuffle=False, last_batch="keep")
    # Each decode worker makes a whole batch, and the loader hands out a new one only as one is taken: ``prefetch``
    # batches ahead keep up to ``prefetch + 1`` workers busy. One per worker keeps them all busy and bounds what waits
    # in /dev/shm to about one (uint8) batch per worker; MXNet's default, two per worker, only queues a second one.
    return gluon.data.DataLoader(
        data, num_workers=workers, thread_pool=not processes, prefetch=workers, pin_memory=pin_memory, **batching
    )


def save_checkpoint(folder, epoch: int, settings: dict, history: dict, net, trainer) -> None:
    """The parameters and the trainer's state (Adam's moments, its update count and so the schedule) in one folder."""

    def write(path):
        path.mkdir()
        net.save_parameters(str(path / "model.params"))
        trainer.save_states(str(path / "trainer.states"))

    checkpoints.save(folder, epoch, ".gluon", write, settings, history)


def load_checkpoint(checkpoint: checkpoints.Checkpoint, net, trainer, contexts: list) -> tuple[int, dict]:
    """Load what :func:`save_checkpoint` wrote onto every context; returns the epochs finished and the history."""
    net.load_parameters(str(checkpoint.state / "model.params"), ctx=contexts)
    trainer.load_states(str(checkpoint.state / "trainer.states"))
    return checkpoint.epoch, checkpoint.history
