"""Chainer pieces for the Chainer notebook and its ChainerMN training script: devices, model, data, evaluation.

Imported only by the Chainer notebook, its script and tests (``import common`` does not import Chainer); Chainer
itself is imported through :mod:`common.chainer.imports`, which makes it importable in this environment.
"""

from __future__ import annotations

import functools
import importlib.metadata
import math
import re
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.chainer.imports import chainer, chainermn
from common.data import image_transforms
from common.errors import InputError
from common.measure.phases import timed_steps
from common.run import checkpoints, devices, params, protocol
from common.run.devices import threads_per_device
from common.run.params import BATCH_NORM_MOMENTUM, IMAGENET_MEAN, IMAGENET_STD, NUM_CLASSES

F = chainer.functions
L = chainer.links

BN_EPS = 1e-5  # PyTorch's


# ---------------------------------------------------------------- devices, precision, launch


@dataclass(frozen=True)
class GPUCheck:
    ok: bool
    message: str


def check_gpu(devices: int) -> GPUCheck:
    """Can Chainer train on GPUs here? A forward and backward pass of a small convolution on ``@cupy:0`` decides.

    Chainer 7.8.1 was released for CuPy 7; the GPU build of this environment (envs/mxnet-chainer/cuda11.txt) gives it
    CuPy 13, the newest that accepts numpy 1.x, with NVIDIA's cu11 libraries (cuDNN 8 among them): where an API
    Chainer uses is gone or a library does not load, it runs without cuDNN (slower convolutions) or not at all.
    ``pure_nccl`` also needs CuPy's NCCL bindings with a NCCL library. Whatever fails is named in the message.
    """
    from chainer.backends import cuda

    if not cuda.available:
        return GPUCheck(False, f"Chainer cannot use CuPy: {getattr(cuda, '_resolution_error', 'CuPy not installed')}")
    try:
        device = chainer.get_device("@cupy:0")
        link = L.Convolution2D(3, 4, 3, pad=1)
        link.to_device(device)
        x = chainer.Variable(device.send(np.ones((2, 3, 8, 8), np.float32)))
        F.sum(link(x)).backward()
        device.device.synchronize()
        if not np.isfinite(float(F.sum(link.W.grad_var).array)):
            raise RuntimeError("the gradient is not finite")
    except Exception as error:  # CuPy and CUDA raise many types; each is reported, none is fatal here
        return GPUCheck(False, f"a small convolution on @cupy:0 failed ({type(error).__name__}: {error})")
    notes = [f"CuPy {cuda.cupy.__version__}"]
    if not cuda.cudnn_enabled:
        notes.append(f"cuDNN off ({getattr(cuda, '_resolution_error', 'disabled')}): convolutions use im2col + cuBLAS")
    if devices > 1 and not chainermn.nccl._available:
        return GPUCheck(False, "the pure_nccl communicator needs CuPy's NCCL bindings (cupy.cuda.nccl), not usable")
    return GPUCheck(True, "Chainer trains on GPUs: " + "; ".join(notes))


def resolve_devices(requested: int | None) -> devices.Devices:
    """:func:`common.run.devices.resolve`, then, on a GPU box, :func:`check_gpu`: a stop naming what failed, the
    driver, CuPy's CUDA build and the fix, when Chainer cannot train on the GPUs."""
    hardware = devices.resolve(requested)
    if hardware.kind != "gpu":
        return hardware
    check = check_gpu(hardware.count)
    framework = f"Chainer {chainer.__version__} with {cupy_name()}"
    usable = hardware.count if check.ok else 0
    devices.require_usable(hardware, framework, usable, cupy_cuda_build(), why=check.message)
    print(check.message)
    return hardware


def cupy_name() -> str:
    from chainer.backends import cuda

    return f"CuPy {cuda.cupy.__version__}" if cuda.available else "no usable CuPy"


def cupy_cuda_build() -> str | None:
    """The CUDA version the installed CuPy package is built for (``cupy-cuda11x``: 11), None without one."""
    for dist in importlib.metadata.distributions():
        if match := re.fullmatch(r"cupy-cuda(\d+)x", dist.metadata["Name"] or ""):
            return match.group(1)
    return None


def check_pretrained(pretrained: bool) -> None:
    params.check_not_pretrained(
        pretrained, "Chainer publishes no ImageNet DenseNet-121 weights (its model zoo has no DenseNet)"
    )


def communicator_name(device_kind: str) -> str:
    """NCCL all-reduce between GPUs; plain MPI all-reduce of numpy arrays between CPU processes."""
    return "pure_nccl" if device_kind == "gpu" else "naive"


def precision_used(precision: str, device_kind: str) -> str:
    """Chainer's ``mixed16`` (fp16 compute, fp32 master weights) on GPUs; on CPUs Chainer has fp32 only."""
    return "mixed16" if precision == "mixed" and device_kind == "gpu" else "fp32"


def mpiexec() -> str:
    """The ``mpiexec`` of the ``mpich`` wheel installed in this environment (or the one on PATH)."""
    local = Path(sysconfig.get_path("scripts")) / "mpiexec"
    found = str(local) if local.is_file() else shutil.which("mpiexec")
    if not found:
        raise RuntimeError("mpiexec not found: the mxnet-chainer environment installs it (make setup)")
    return found


def mpiexec_command(script, nproc: int, *args) -> list[str]:
    """One process per device on this machine, each running ``script`` with this Python."""
    return [mpiexec(), "-n", str(nproc), sys.executable, str(script), *map(str, args)]


def mpiexec_hosts_command(script, hosts: list[str], nproc_per_host: int, *args) -> list[str]:
    """MPICH's ``mpiexec`` over several machines: ``nproc_per_host`` processes on each of ``hosts``.

    Hydra starts the remote processes over ssh (passwordless, from the first host), so every host needs
    this environment, the script and the data at the same paths; MPI then numbers the ranks host by host.
    """
    spread = ",".join(f"{host}:{nproc_per_host}" for host in hosts)
    command = [mpiexec(), "-hosts", spread, "-n", str(nproc_per_host * len(hosts))]
    return [*command, sys.executable, str(script), *map(str, args)]


def weights_fingerprint(model: chainer.Link) -> str:
    """:func:`common.run.protocol.fingerprint` of every parameter and persistent value (BatchNorm statistics
    included)."""
    serializer = chainer.serializers.DictionarySerializer()
    serializer.save(model)
    cpu = chainer.backend.CpuDevice()
    return protocol.fingerprint((name, cpu.send(serializer.target[name])) for name in sorted(serializer.target))


def launch_env(nproc: int) -> dict[str, str]:
    """Each process gets its share of the cores for numpy's BLAS, so simulated devices do not oversubscribe."""
    threads = str(threads_per_device(nproc))
    return {"OMP_NUM_THREADS": threads, "OPENBLAS_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}


# ---------------------------------------------------------------- model


def _conv(in_channels: int, out_channels: int, ksize: int, stride: int = 1, pad: int = 0) -> L.Convolution2D:
    # torchvision's DenseNet: Kaiming-normal weights (fan in, gain sqrt 2), no bias before a BatchNorm
    return L.Convolution2D(
        in_channels, out_channels, ksize, stride, pad, nobias=True, initialW=chainer.initializers.HeNormal()
    )


def _norm(channels: int) -> L.BatchNormalization:
    return L.BatchNormalization(channels, decay=BATCH_NORM_MOMENTUM, eps=BN_EPS)


def _bn_relu(norm: L.BatchNormalization, x):
    # precise BN (recompute_batch_norm_statistics) asks every BatchNorm for its cumulative "finetune" average
    return F.relu(norm(x, finetune=getattr(chainer.config, "precise_bn", False)))


class DenseLayer(chainer.Chain):
    """BN-ReLU-1x1 conv to 4 x growth channels, BN-ReLU-3x3 conv to ``growth`` new channels."""

    def __init__(self, in_channels: int, growth: int = 32, bn_size: int = 4):
        super().__init__()
        with self.init_scope():
            self.norm1 = _norm(in_channels)
            self.conv1 = _conv(in_channels, bn_size * growth, 1)
            self.norm2 = _norm(bn_size * growth)
            self.conv2 = _conv(bn_size * growth, growth, 3, pad=1)

    def forward(self, x):
        new = self.conv2(_bn_relu(self.norm2, self.conv1(_bn_relu(self.norm1, x))))
        return F.concat((x, new), axis=1)  # every layer sees all earlier feature maps


class Transition(chainer.Chain):
    """BN-ReLU-1x1 conv halving the channels, then a 2x2 average pool halving the size."""

    def __init__(self, in_channels: int):
        super().__init__()
        with self.init_scope():
            self.norm = _norm(in_channels)
            self.conv = _conv(in_channels, in_channels // 2, 1)

    def forward(self, x):
        return F.average_pooling_2d(self.conv(_bn_relu(self.norm, x)), 2, 2)


class DenseNet121(chainer.Chain):
    """torchvision's ``densenet121`` as Chainer links: growth 32, blocks (6, 12, 24, 16), 64 initial features.

    A global average pool before the classifier lets any image size from 32 pixels up through.
    """

    def __init__(self, num_classes: int = NUM_CLASSES, growth: int = 32, blocks=(6, 12, 24, 16), init: int = 64):
        super().__init__()
        with self.init_scope():
            self.conv0 = _conv(3, init, 7, stride=2, pad=3)
            self.norm0 = _norm(init)
            self.features = chainer.ChainList()
            channels = init
            for number, layers in enumerate(blocks):
                for _ in range(layers):
                    self.features.append(DenseLayer(channels, growth))
                    channels += growth
                if number < len(blocks) - 1:
                    self.features.append(Transition(channels))
                    channels //= 2
            self.norm5 = _norm(channels)
            # torchvision's nn.Linear start: uniform within 1/sqrt(fan in) (LeCun's bound is sqrt(3/fan in))
            self.classifier = L.Linear(
                channels, num_classes, initialW=chainer.initializers.LeCunUniform(scale=1 / math.sqrt(3))
            )

    def forward(self, x):
        # cover_all=False: PyTorch's output size (floor), so 64 pixels become 16 before the first block
        h = F.max_pooling_2d(_bn_relu(self.norm0, self.conv0(x)), 3, stride=2, pad=1, cover_all=False)
        for link in self.features:
            h = link(h)
        h = _bn_relu(self.norm5, h)
        return self.classifier(F.mean(h, axis=(2, 3)))


def build_densenet121(num_classes: int = NUM_CLASSES, seed: int | None = None) -> DenseNet121:
    """DenseNet-121 with a ``num_classes`` output (6,968,206 trainable parameters for 14).

    Chainer's initializers draw from numpy's global generator: ``seed`` makes the start reproducible. Under
    ``chainer.using_config("dtype", chainer.mixed16)`` the convolutions and the classifier hold fp16 weights and
    BatchNorm keeps fp32 (the optimizer's ``use_fp32_update`` keeps fp32 master copies).
    """
    if seed is not None:
        np.random.seed(seed)
    return DenseNet121(num_classes)


def trainable_parameters(model: chainer.Link) -> int:
    """Parameters (BatchNorm's running statistics are not parameters in Chainer)."""
    return sum(param.size for param in model.params())


# ---------------------------------------------------------------- batch norm statistics


def batch_norms(model: chainer.Link) -> list[L.BatchNormalization]:
    """Every BatchNorm of ``model`` in name order, the same order on every rank."""
    return [link for _, link in sorted(model.namedlinks()) if isinstance(link, L.BatchNormalization)]


def share_batch_norm_statistics(model: chainer.Link, comm) -> None:
    """Average every BatchNorm's running mean and variance over the ranks, so all ranks score images alike.

    ChainerMN averages gradients only: each rank's running statistics follow its own share of the images.
    """
    if comm.size == 1:
        return
    norms = batch_norms(model)
    xp = chainer.backend.get_array_module(norms[0].avg_mean)
    cpu = chainer.backend.CpuDevice()
    local = np.concatenate([cpu.send(array).ravel() for norm in norms for array in (norm.avg_mean, norm.avg_var)])
    total = np.asarray(comm.allreduce_obj(local), np.float64) / comm.size  # a few 10,000 numbers: through the host
    offset = 0
    for norm in norms:
        for array in (norm.avg_mean, norm.avg_var):
            array[...] = xp.asarray(total[offset : offset + array.size].reshape(array.shape), array.dtype)
            offset += array.size


def recompute_batch_norm_statistics(model: chainer.Link, batches, comm) -> int:
    """ "Precise BN": each rank's running averages become the plain mean over ``batches`` (an iterable of images).

    Chainer's BatchNorm has this built in (``finetune=True``: a cumulative average after ``start_finetuning``).
    The ranks' statistics are then averaged, so every rank holds the statistics of all ranks' batches. Returns how
    many batches this rank used.
    """
    for norm in batch_norms(model):
        norm.start_finetuning()
    used = 0
    with chainer.using_config("train", True), chainer.using_config("precise_bn", True), chainer.no_backprop_mode():
        for images in batches:
            model(images)
            used += 1
    share_batch_norm_statistics(model, comm)
    return used


# ---------------------------------------------------------------- data


class ChestXrayImages(chainer.dataset.DatasetMixin):
    """The images numbered ``indices`` of a :class:`common.data.chestxray.Split`; items are (image, labels, index).

    The pixels are the split's (the prepared copy's row, or the PNG); :mod:`common.data.image_transforms` augments them
    into a uint8 gray image (1, size, size), which :func:`to_device` normalizes on the device.
    Items are evaluation images (resize, center crop);
    :meth:`load` with an ``epoch`` gives the augmented training image, drawn from ``(seed, epoch, index)``: the
    same crop whichever rank or decode process loads it, on any number of devices.
    """

    def __init__(self, split, indices, image_size: int, seed: int = 0):
        self.split, self.labels = split, split.labels.astype(np.int32)  # Chainer's sigmoid loss wants int
        self.indices, self.image_size, self.seed = np.asarray(indices, np.int64), image_size, seed

    def __len__(self) -> int:
        return len(self.indices)

    def get_example(self, position: int):
        return self.load(int(self.indices[position]))

    def load(self, index: int, epoch: int | None = None):
        augment = None if epoch is None else (self.seed, epoch, index)
        pixels = image_transforms.transform(self.split.pixels(index), self.image_size, augment)
        return pixels, self.labels[index], np.int32(index)


class TrainingEpochs(chainer.dataset.DatasetMixin):
    """``epochs`` shuffled passes over ``images`` laid end to end, read in order by the training iterator.

    Each pass is a new permutation drawn from ``(seed, epoch)`` and keeps ``steps_per_epoch`` full batches (the
    rest is dropped, as PyTorch's ``drop_last``). Item ``k`` is a pure function of ``k``, so the decode processes
    of a :class:`~chainer.iterators.MultiprocessIterator` may load items in any order and the result is the same.
    """

    def __init__(self, images: ChestXrayImages, batch_size: int, epochs: int, seed: int = 0, first_epoch: int = 0):
        self.images, self.batch_size, self.epochs, self.seed = images, batch_size, epochs, seed
        self.first_epoch = first_epoch
        self.steps_per_epoch = len(images) // batch_size
        if self.steps_per_epoch == 0:
            raise InputError(
                f"A rank holds {len(images)} training images, fewer than one batch of {batch_size}: "
                f"lower BATCH_SIZE_PER_DEVICE or DEVICES, or raise MAX_IMAGES."
            )

    def __len__(self) -> int:
        return self.epochs * self.steps_per_epoch * self.batch_size

    @functools.lru_cache(maxsize=2)  # noqa: B019 (two permutations per process, one dataset per run)
    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.images))

    def get_example(self, k: int):
        epoch, position = divmod(int(k), self.steps_per_epoch * self.batch_size)
        epoch += self.first_epoch
        return self.images.load(int(self.images.indices[self._order(epoch)[position]]), epoch)


def iterator(dataset, batch_size: int, workers: int):
    """Batches in dataset order, decoded by ``workers`` processes ahead of the training loop.

    ``MultiprocessIterator`` forks its workers from the MPI process; they only decode images and never call MPI,
    which is safe with MPICH on one machine. Shuffling lives in the dataset (:class:`TrainingEpochs`). The workers
    hand over one batch at a time through shared memory sized from the first batch (``shared_mem=None``), and
    ``n_prefetch`` batches wait in this process: uint8 gray images keep both small.
    """
    return chainer.iterators.MultiprocessIterator(
        dataset, batch_size, repeat=False, shuffle=False, n_processes=workers, n_prefetch=2
    )


def normalize(images):
    """uint8 gray images (N, 1, H, W) as the model's input: ImageNet-normalized float32 (N, 3, H, W), computed on the
    device that holds them (numpy or CuPy)."""
    x = images.astype(np.float32) / 255
    xp = chainer.backend.get_array_module(images)
    return xp.concatenate([(x - mean) / std for mean, std in zip(IMAGENET_MEAN, IMAGENET_STD)], axis=1)


def to_device(batch, device, dtype=None):
    """A list of (image, labels, index) items as arrays on ``device``: the uint8 images travel as they are and are
    normalized there (:func:`normalize`), then cast to ``dtype`` when given."""
    images, labels, indices = chainer.dataset.concat_examples(batch, device)
    images = normalize(images)
    if dtype is not None and images.dtype != dtype:
        images = images.astype(dtype)
    return images, labels, indices


# ---------------------------------------------------------------- evaluation and benchmark


def predict_all(model: chainer.Link, images: ChestXrayImages, comm, device, batch_size: int, workers: int, dtype=None):
    """Labels and sigmoid scores of every image of the split, gathered on rank 0 (``None, None`` on the others).

    Each rank scores its own share; rank 0 puts them back in split order and checks that every image of the
    split was scored exactly once.
    """
    indices, labels, scores = [], [], []
    with (
        chainer.using_config("train", False),
        chainer.no_backprop_mode(),
        iterator(images, batch_size, workers) as batches,
    ):
        for batch in batches:
            x, t, index = to_device(batch, device, dtype)
            scores.append(F.sigmoid(F.cast(model(x), np.float32)).array)
            labels.append(t)
            indices.append(index)
    cpu = chainer.backend.CpuDevice()
    local = [np.concatenate([cpu.send(a) for a in arrays]) for arrays in (indices, labels, scores)]
    gathered = comm.gather_obj(local)
    if comm.rank != 0:
        return None, None
    index, labels, scores = (np.concatenate(parts) for parts in zip(*gathered))
    order = np.argsort(index)
    if not np.array_equal(index[order], np.arange(len(images.labels))):
        raise AssertionError(f"{len(index)} scores for {len(images.labels)} images: not every image exactly once")
    return labels[order].astype(np.float32), scores[order]


def synchronize(device) -> None:
    """Wait for the GPU's queued work (a CPU device has none)."""
    if getattr(device, "device", None) is not None:  # GpuDevice: device.device is the cupy.cuda.Device
        device.device.synchronize()


def sigmoid_loss(logits, labels):
    """Binary cross-entropy on logits, the mean over images and findings (as PyTorch's BCEWithLogitsLoss)."""
    return F.sigmoid_cross_entropy(F.cast(logits, np.float32), labels, normalize=True, reduce="mean")


def time_steps(
    model, optimizer, batch_size: int, image_size: int, steps: int, device, comm, dtype=np.float32, phases=None
) -> float:
    """Images per second of all ranks together: ``steps`` training steps on one fixed random batch held in device
    memory, ``batch_size`` images on each of ``comm``'s ranks (the multi-node optimizer keeps their steps in step).
    The batch is uint8 gray, as the iterator delivers it: each step makes it the model's input on the device
    (:func:`normalize`, then ``dtype``), as training does.

    Two warm-up steps are not timed (memory allocation, kernel compilation on GPUs); ``phases`` (a
    :class:`common.measure.phases.Phases`) gets them and the timed steps.
    """
    rng = np.random.default_rng(0)
    images = device.send(rng.integers(0, 256, (batch_size, 1, image_size, image_size), np.uint8))
    labels = device.send(rng.integers(0, 2, (batch_size, NUM_CLASSES)).astype(np.int32))
    seconds = timed_steps(
        lambda: optimizer.update(lambda: sigmoid_loss(model(normalize(images).astype(dtype)), labels)),
        steps,
        lambda _: synchronize(device),
        phases,
    )
    return steps * batch_size * comm.size / seconds


def save_checkpoint(folder, epoch: int, settings: dict, history: dict, model, optimizer, comm) -> None:
    """Rank 0 writes the weights (BatchNorm statistics included) and Adam's state; every rank waits until it is done.

    The ranks hold the same weights, and their BatchNorm statistics were averaged before validation.
    """
    if comm.rank == 0:

        def write(path):
            path.mkdir()
            chainer.serializers.save_npz(str(path / "model.npz"), model)
            chainer.serializers.save_npz(str(path / "optimizer.npz"), optimizer)

        checkpoints.save(folder, epoch, ".chainer", write, settings, history)
    comm.mpi_comm.Barrier()  # no rank runs ahead of a checkpoint that a kill could still lose


def load_checkpoint(checkpoint: checkpoints.Checkpoint, model, optimizer) -> tuple[int, dict]:
    """Every rank loads what :func:`save_checkpoint` wrote; returns the epochs finished and the history so far."""
    chainer.serializers.load_npz(str(checkpoint.state / "model.npz"), model)
    chainer.serializers.load_npz(str(checkpoint.state / "optimizer.npz"), optimizer)
    return checkpoint.epoch, checkpoint.history
