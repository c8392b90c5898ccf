"""Gluon data parallelism and the Gluon notebook's helpers, on simulated CPU contexts."""

import ctypes
import math
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from common.data import chestxray
from common.errors import InputError
from common.mxnet import imports as mxnet_import
from common.run import checkpoints, devices, params
from common.run.params import IMAGENET_MEAN, IMAGENET_STD, NUM_CLASSES

mx = mxnet_import.load()
from mxnet import autograd, gluon  # noqa: E402

from common.mxnet import utils as gu  # noqa: E402

GLOBAL_BATCH = 8
CPUS = [mx.cpu(0), mx.cpu(1)]


def test_mxnet_refuses_hopper_and_newer_gpus_naming_why(monkeypatch):
    """No official MXNet wheel has kernels for compute capability 9.0 (H100, H200): the first operation would fail."""
    hopper = devices.Devices("gpu", 1, 1, ("NVIDIA H200",), 139.8, (9, 0))
    with pytest.raises(InputError, match=r"NVIDIA H200 \(compute capability 9\.0\).*sm_86.*A100, L40.*CPU devices"):
        gu.check_gpus(hopper)
    gu.check_compute_capability(devices.Devices("gpu", 1, 1, ("NVIDIA A100-SXM4-80GB",), 80.0, (8, 0)))
    gu.check_compute_capability(devices.Devices("gpu", 1, 1, ("NVIDIA L40S",), 45.0, (8, 9)))


def test_gpus_this_mxnet_cannot_use_stop_the_notebook(monkeypatch):
    """The CPU-only `mxnet` package on a GPU box (here: this environment's) names its build and the fix."""
    monkeypatch.setattr(devices, "driver_version", lambda: "535.104.05")
    ampere = devices.Devices("gpu", 2, 2, ("NVIDIA A100-SXM4-80GB",) * 2, 80.0, (8, 0))
    assert gu.cuda_build() is None
    with pytest.raises(InputError, match=r"MXNet 1\.9\.1 \(a build without CUDA\) can use 0 of the 2.*make setup"):
        gu.check_gpus(ampere)


def test_mxnet_import_restores_the_numpy_alias_and_keeps_its_threads():
    assert np.bool is bool and mxnet_import.load() is sys.modules["mxnet"]
    with pytest.warns(UserWarning, match="keeps those threads"):
        mxnet_import.load(threads=12345)


def test_the_importing_thread_copies_with_one_openmp_thread_and_the_engines_keep_theirs():
    """An asnumpy() in a thread with an OpenMP team of its own slowed every later step (common/mxnet/imports.py)."""
    gomp = ctypes.CDLL("libgomp.so.1")
    others = []
    thread = threading.Thread(target=lambda: others.append(gomp.omp_get_max_threads()))
    thread.start()
    thread.join()
    assert gomp.omp_get_max_threads() == 1
    assert others == [int(os.environ.get("OMP_NUM_THREADS", len(os.sched_getaffinity(0))))]


def test_densenet_has_the_shared_parameter_count_and_takes_small_images():
    net = gu.build_densenet121([mx.cpu(0)])
    assert gu.trainable_parameters(net) == 6_968_206
    net.hybridize(static_alloc=True)
    for size in (32, 64, 224):
        assert net(mx.nd.zeros((2, 3, size, size))).shape == (2, NUM_CLASSES)


def make_net(batch_norm: bool, ctx) -> gluon.HybridBlock:
    mx.random.seed(0)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(4, 3, padding=1, in_channels=3))
    if batch_norm:
        net.add(gluon.nn.BatchNorm(in_channels=4))
    net.add(gluon.nn.Activation("relu"), gluon.nn.GlobalAvgPool2D(), gluon.nn.Dense(NUM_CLASSES, in_units=4))
    net.initialize(mx.init.Xavier(), ctx=ctx)
    net.hybridize()
    return net


def make_batch():
    rng = np.random.default_rng(1)
    images = mx.nd.array(rng.normal(size=(GLOBAL_BATCH, 3, 8, 8)))
    labels = mx.nd.array(rng.integers(0, 2, (GLOBAL_BATCH, NUM_CLASSES)))
    return images, labels


def one_step(ctx, kvstore="local", divide_by=GLOBAL_BATCH, batch_norm=False):
    """The notebook's train_step: split the batch, one loss per context, the trainer sums and divides."""
    net = make_net(batch_norm, ctx)
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.5}, kvstore=kvstore)
    images, labels = make_batch()
    shares = zip(gluon.utils.split_and_load(images, ctx), gluon.utils.split_and_load(labels, ctx))
    with autograd.record():
        losses = [gluon.loss.SigmoidBinaryCrossEntropyLoss()(net(x), y) for x, y in shares]
    gu.backward(losses, trainer, "float32")
    trainer.step(divide_by)
    return net


def weights(net, ctx) -> dict[str, np.ndarray]:
    """By position and kind (``2:weight``): Gluon numbers the layer names of every new network anew."""
    params = net.collect_params().values()
    return {f"{i}:{p.name.rsplit('_', 1)[1]}": p.data(ctx).asnumpy() for i, p in enumerate(params)}


@pytest.mark.parametrize("kvstore", ["local", "device"])
def test_one_step_on_two_contexts_equals_one_step_on_one(kvstore):
    start = weights(make_net(False, [mx.cpu(0)]), mx.cpu(0))
    single = weights(one_step([mx.cpu(0)]), mx.cpu(0))
    net = one_step(CPUS, kvstore)
    for ctx in CPUS:  # every copy took the same step
        for name, value in weights(net, ctx).items():
            np.testing.assert_allclose(value, single[name], rtol=0, atol=1e-6, err_msg=name)
    step = max(np.abs(single[name] - start[name]).max() for name in start)
    assert step > 1e-3, "the step is large enough for the comparison to mean something"


def test_dividing_by_the_share_instead_of_the_global_batch_doubles_the_step():
    """The negative control: the check above would catch the classic normalization mistake."""
    start = weights(make_net(False, [mx.cpu(0)]), mx.cpu(0))
    single = weights(one_step([mx.cpu(0)]), mx.cpu(0))
    wrong = weights(one_step(CPUS, divide_by=GLOBAL_BATCH // len(CPUS)), mx.cpu(0))
    name = list(start)[-2]  # the classifier's weight
    np.testing.assert_allclose(wrong[name] - start[name], 2 * (single[name] - start[name]), rtol=1e-4, atol=1e-7)


def test_batch_norm_statistics_stay_per_context_until_shared():
    net = one_step(CPUS, batch_norm=True)  # the trainer's first step copies the first context's values to all
    images, _ = make_batch()
    with autograd.record():  # as the next training step does: each context sees its own share
        outputs = [net(share) for share in gluon.utils.split_and_load(images, CPUS)]
    autograd.backward(outputs)  # MXNet updates the running statistics in the backward pass
    running = net.collect_params(".*running_mean")
    copies = [p.data(ctx).asnumpy() for p in running.values() for ctx in CPUS]
    assert not np.allclose(*copies), "each context updated its statistics from its own share"
    gu.share_batch_norm_statistics(net, CPUS)
    copies = [p.data(ctx).asnumpy() for p in running.values() for ctx in CPUS]
    np.testing.assert_array_equal(*copies)


def test_precise_batch_norm_is_the_mean_over_batches_of_the_first_share():
    net = make_net(True, CPUS)
    conv, norm = net[0], net[1]
    batches = [(mx.nd.random.randint(0, 256, shape=(4, 1, 8, 8)).astype("uint8"), None) for _ in range(3)]
    gu.recompute_batch_norm_statistics(net, batches, 2, CPUS)
    # the first context gets the first half of each batch, as rank 0 gets its share under DDP
    means = [conv(gu.normalize(images[:2])).mean(axis=(0, 2, 3)).asnumpy() for images, _ in batches[:2]]
    for ctx in CPUS:
        np.testing.assert_allclose(norm.running_mean.data(ctx).asnumpy(), np.mean(means, axis=0), rtol=1e-5)
    assert norm._kwargs["momentum"] == 0.9, "the training momentum is restored"


def test_predict_all_scores_every_image_once_in_order(standin):
    split = chestxray.load(standin, seed=0)["test"]
    net = make_net(False, CPUS)
    data = gu.loader(split, 32, batch_size=len(split) - 1, training=False, workers=0)  # a last batch of 1 image
    labels, scores = gu.predict_all(net, data, CPUS)
    np.testing.assert_array_equal(labels, split.labels)
    alone = gu.predict_all(make_net(False, [mx.cpu(0)]), data, [mx.cpu(0)])[1]
    np.testing.assert_allclose(scores, alone, rtol=1e-5)


def test_augmentation_depends_on_seed_epoch_and_image_only(standin):
    split = chestxray.load(standin, seed=0)["train"]
    data = gu.ChestXrayDataset(split, 32, training=True, seed=0)
    first, again = data[len(data) + 3][0], gu.ChestXrayDataset(split, 32, training=True, seed=0)[len(data) + 3][0]
    np.testing.assert_array_equal(first, again)
    assert first.shape == (1, 32, 32) and first.dtype == np.uint8
    assert not np.array_equal(first, data[3][0]), "another epoch, another crop"
    evaluated = gu.ChestXrayDataset(split, 32, training=False)[3][0]
    np.testing.assert_array_equal(evaluated, gu.ChestXrayDataset(split, 32, training=False)[3][0])


def test_sampler_reshuffles_each_epoch_and_drops_the_partial_batch():
    sampler = gu.EpochBatchSampler(10, 4, seed=0)
    first, second = list(sampler), list(sampler)
    assert len(first) == len(sampler) == 2 and all(len(batch) == 4 for batch in first)
    assert all(key < 10 for batch in first for key in batch)
    assert all(10 <= key < 20 for batch in second for key in batch), "the keys carry the epoch"
    assert [k % 10 for batch in first for k in batch] != [k % 10 for batch in second for k in batch]
    assert list(gu.EpochBatchSampler(10, 4, seed=0)) == first


def test_sampler_parts_split_every_global_batch_between_the_workers():
    whole = list(gu.EpochBatchSampler(12, 6, seed=3))
    parts = [list(gu.EpochBatchSampler(12, 6, seed=3, part=(index, 2))) for index in (0, 1)]
    assert all(len(batch) == 3 for part in parts for batch in part)
    assert [first + second for first, second in zip(*parts)] == whole, "the parts of a step make its global batch"


def test_simulated_devices_need_no_gpu_check():
    gu.check_gpus(devices.resolve(2, gpus=[]))  # CPU contexts: nothing to refuse, whatever this MXNet's build


def test_kvstore_choice():
    assert gu.check_kvstore(None, "gpu") == "device" and gu.check_kvstore(None, "cpu") == "local"
    with pytest.raises(InputError, match="KVSTORE must be one of"):
        gu.check_kvstore("dist", "cpu")
    with pytest.raises(InputError, match="needs GPUs"):
        gu.check_kvstore("nccl", "cpu")


def test_dist_kvstore_needs_a_cluster_and_refuses_checkpoints(monkeypatch):
    monkeypatch.delenv("DMLC_ROLE", raising=False)
    with pytest.raises(InputError, match="DMLC_ROLE=worker"):
        gu.check_kvstore("dist_sync", "cpu")
    with pytest.raises(InputError, match="needs GPUs"):
        gu.check_kvstore("dist_device_sync", "cpu")
    monkeypatch.setenv("DMLC_ROLE", "worker")
    assert gu.check_kvstore("dist_sync", "cpu") == "dist_sync"
    with pytest.raises(InputError, match="CHECKPOINT_DIR with KVSTORE='dist_sync'"):
        gu.check_kvstore("dist_sync", "cpu", checkpoint_dir="checkpoints")
    assert gu.create_kvstore("local") == ("local", 0, 1), "one machine: the Trainer creates its kvstore"


def test_time_steps_gives_the_rate_of_all_workers_from_this_workers_share():
    calls = []
    rate = gu.time_steps(lambda images, labels: calls.append((images, labels)), CPUS, 8, 32, steps=3, workers=2)
    assert len(calls) == 5 and rate > 0 and math.isfinite(rate)
    images, labels = calls[0]
    assert [x.shape for x in images] == [(2, 1, 32, 32)] * 2 and [y.shape for y in labels] == [(2, NUM_CLASSES)] * 2
    assert all(x.dtype == np.uint8 for x in images), "gray bytes, as the loader sends them: the step normalizes"
    assert [x.context for x in images] == [y.context for y in labels] == CPUS, "each context's share, on it"
    assert all(shares[0] is images and shares[1] is labels for shares in calls), (
        "split and loaded once: no copy to the devices in the timed steps"
    )


def host_normalized(gray: np.ndarray) -> np.ndarray:
    """What the loader delivered before the devices normalized (``tests/test_image_transforms.py`` checks the pixels
    themselves): float32 /255, then ImageNet's mean and deviation, one gray channel made three."""
    mean, std = (np.array(values, np.float32)[:, None, None] for values in (IMAGENET_MEAN, IMAGENET_STD))
    return (gray.astype(np.float32) / 255 - mean) / std


def test_loader_sends_gray_bytes_that_each_context_normalizes_as_the_host_did(standin):
    split = chestxray.load(standin, seed=0)["train"]
    images, labels = next(iter(gu.loader(split, 32, batch_size=4, training=True, workers=0)))
    assert images.shape == (4, 1, 32, 32) and images.dtype == np.uint8, "one byte per pixel, 1/12 of float32 RGB"
    assert labels.dtype == np.float32
    shares = [gu.normalize(x) for x in gluon.utils.split_and_load(images, CPUS)]
    assert [x.context for x in shares] == CPUS and all(x.dtype == np.float32 for x in shares)
    np.testing.assert_array_equal(mx.nd.concat(*shares, dim=0).asnumpy(), host_normalized(images.asnumpy()))


def test_loader_keeps_one_batch_per_decode_worker_in_flight(standin, monkeypatch):
    """A worker decodes a whole batch: one batch each keeps every worker busy (MXNet's default queues two each)."""
    requested = []
    load = gu.ChestXrayDataset.__getitem__
    monkeypatch.setattr(gu.ChestXrayDataset, "__getitem__", lambda data, key: requested.append(key) or load(data, key))
    split = chestxray.load(standin, seed=0)["train"]
    workers, batch_size = 3, 2
    assert len(split) >= 4 * workers * batch_size, "enough batches for MXNet's default to queue more"
    batches = iter(gu.loader(split, 32, batch_size, training=True, workers=workers, processes=False))
    next(batches)
    deadline = time.monotonic() + 30
    while len(requested) < (workers + 1) * batch_size and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # what else the threads were given
    assert len(requested) == (workers + 1) * batch_size


def test_pinned_loader_delivers_page_locked_batches(standin):
    split = chestxray.load(standin, seed=0)["test"]
    images, labels = next(iter(gu.loader(split, 32, batch_size=2, training=False, workers=0, pin_memory=True)))
    assert images.context == labels.context == mx.cpu_pinned(0)


def test_mxnet_then_chainer_in_one_process():
    """Both retired frameworks need distutils; whichever comes first, the other still imports."""
    code = "from common.mxnet import imports; imports.load(); from common.chainer.imports import chainer"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_the_trainers_schedule_is_the_projects_counted_from_update_1():
    """Each ``trainer.step`` uses the rate of :func:`params.schedule_factor` at its update's number (from 1)."""
    steps, peak = 30, 0.1
    net = gluon.nn.Dense(2, in_units=4)
    net.initialize(ctx=CPUS)
    schedule = gu.warmup_cosine(peak, steps)
    trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": peak, "lr_scheduler": schedule})
    used = []
    for step in range(steps):
        shares = gluon.utils.split_and_load(mx.nd.ones((4, 4)) * step, CPUS)
        with autograd.record():
            losses = [net(x).sum() for x in shares]
        autograd.backward(losses)
        trainer.step(4)
        used.append(trainer.learning_rate)  # the rate of the update just made
    assert used == pytest.approx([peak * params.schedule_factor(number, steps) for number in range(1, steps + 1)])


def test_a_restored_checkpoint_continues_exactly_like_the_uninterrupted_run(tmp_path):
    """The parameters, Adam's moments and the trainer's update count (the schedule's position) come back."""
    batches = [mx.nd.array(np.random.default_rng(step).normal(size=(8, 4))) for step in range(6)]

    def build(seed):
        mx.random.seed(seed)
        net = gluon.nn.Dense(2, in_units=4)
        net.initialize(mx.init.Xavier(), ctx=CPUS)
        schedule = mx.lr_scheduler.CosineScheduler(max_update=6, base_lr=0.1)
        trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 0.1, "lr_scheduler": schedule})
        return net, trainer

    def train(net, trainer, steps):
        for batch in steps:
            shares = gluon.utils.split_and_load(batch, CPUS)
            with autograd.record():
                losses = [(net(x) ** 2).mean() for x in shares]
            autograd.backward(losses)
            trainer.step(8)

    net, trainer = build(0)
    train(net, trainer, batches[:3])
    gu.save_checkpoint(tmp_path, 3, {"EPOCHS": 6}, {"train_loss": [0.5]}, net, trainer)
    train(net, trainer, batches[3:])

    resumed, resumed_trainer = build(1)
    assert gu.load_checkpoint(checkpoints.complete(tmp_path)[-1], resumed, resumed_trainer, CPUS) == (
        3,
        {"train_loss": [0.5]},
    )
    train(resumed, resumed_trainer, batches[3:])
    for expected, found in zip(net.collect_params().values(), resumed.collect_params().values()):  # names differ
        for context in CPUS:
            np.testing.assert_array_equal(found.data(context).asnumpy(), expected.data(context).asnumpy())
