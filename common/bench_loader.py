"""Benchmark of every framework's training input pipeline, in images per second per core.

    python -m common.bench_loader [--images 64] [--size 1024] [--crop 224] [--batch 16] [--readme README.md]

On a generated stand-in of the real images' size (1024 px), prepared once at ``params.prepared_size(crop)``, it
times on one core:
  1. a plain PIL decode loop: the bound of any pipeline that reads PNGs (none decodes faster than libpng);
  2. each framework's training pipeline (read + random resized crop + flip + normalize, batched by its own loader
     with no worker process and one thread), once from the prepared copy and once from the PNGs;
and, with every core, ``prepare.ensure`` building a fresh prepared copy.

A rate per core is images per CPU-second of this process, all its threads together: a pipeline that spreads over
more threads than asked is not counted as faster, and other processes sharing the cores do not slow it down.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import platform
import tempfile
import time

THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
if __name__ == "__main__":  # numpy's BLAS, MXNet and TensorFlow size their thread pools on import: one thread each
    os.environ.update(dict.fromkeys(THREAD_VARIABLES, "1"))

import numpy as np  # noqa: E402

from common import chestxray, devices, params, prepare, report, synthetic  # noqa: E402

README_START, README_END = "<!-- bench-loader:start -->", "<!-- bench-loader:end -->"

# The targets, printed beside the figures (not asserted: they depend on the machine).
TORCH_PREPARED_TARGET = 1500  # images/s per core at 224 px
PREPARED_WITHIN = 2  # the other frameworks' prepared pipelines: at least PyTorch's rate / this
PNG_SHARE_TARGET = 0.9  # PNG pipeline / decode bound
PREPARE_SPEEDUP_TARGET = 1.8  # prepare on 2 cores / one core's decode rate


def per_core_rate(one_pass, repeats: int) -> float:
    """Images per CPU-second of the best of ``repeats`` calls of ``one_pass`` (which returns its image count), after
    an untimed one that traces graphs, opens files and warms the page cache."""
    one_pass()
    best = math.inf
    for _ in range(repeats):
        start = time.process_time()
        images = one_pass()
        best = min(best, (time.process_time() - start) / images)
    return 1 / best


# One pass of each framework's training pipeline over a split; each returns the images it delivered.


def torch_pass(split, crop: int, batch: int):
    import torch

    from common import torch_utils

    torch.set_num_threads(1)
    dataset = torch_utils.ChestXrayDataset(split, torch_utils.train_transform(crop))
    data = torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=True, drop_last=True, num_workers=0)
    return lambda: sum(len(images) for images, _, _ in data)


def tensorflow_pass(split, crop: int, batch: int):
    from common import tf_utils
    from common.tf_import import tf

    try:
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    except RuntimeError:  # TensorFlow already started in this process (a test): the CPU time still counts every thread
        pass
    options = tf.data.Options()
    options.threading.private_threadpool_size = 1
    options.threading.max_intra_op_parallelism = 1
    data = tf_utils.dataset(split, crop, batch, training=True, seed=0).with_options(options)
    return lambda: sum(int(images.shape[0]) for images, _ in data)


def gluon_pass(split, crop: int, batch: int):
    from common import mxnet_import

    mxnet_import.load(threads=1)
    from common import gluon_utils

    data = gluon_utils.loader(split, crop, batch, training=True, workers=0)
    return lambda: sum(images.shape[0] for images, _ in data)


def chainer_pass(split, crop: int, batch: int):
    from common import chainer_utils
    from common.chainer_import import chainer

    images = chainer_utils.ChestXrayImages(split, range(len(split)), crop, seed=0)
    epoch = chainer_utils.TrainingEpochs(images, batch, epochs=1)

    def one_pass():
        batches = chainer.iterators.SerialIterator(epoch, batch, repeat=False, shuffle=False)
        return sum(len(chainer.dataset.concat_examples(items)[0]) for items in batches)

    return one_pass


# torchvision first: imported after TensorFlow it crashes the process (see tests/conftest.py)
PIPELINES = {"PyTorch": torch_pass, "TensorFlow/Keras": tensorflow_pass, "Gluon": gluon_pass, "Chainer": chainer_pass}


def pil_decode_pass(paths):
    from PIL import Image

    def one_pass():
        for path in paths:
            with Image.open(path) as image:
                image.load()
        return len(paths)

    return one_pass


def timed_prepare(paths: list[str], size: int, folder) -> tuple[prepare.Prepared, dict]:
    """A fresh prepared copy in ``folder`` made with every core; returns it and what it took: ``images``, ``rate`` (per
    second of wall time) and ``cpu_rate`` (per CPU-second of its processes, their start-up included).

    A prepare of the whole data set spends seconds starting its processes and hours decoding; a small stand-in would
    time mostly the start: its files are listed as many times as it takes to give every core 2,048 images.
    """
    cores = devices.cpu_cores()
    listed = paths * math.ceil(2048 * cores / len(paths))
    start, children = time.perf_counter(), _children_cpu()
    prepared = prepare.ensure(folder, listed, size, workers=cores)
    wall, cpu = time.perf_counter() - start, _children_cpu() - children
    return prepared, {"images": len(listed), "rate": len(listed) / wall, "cpu_rate": len(listed) / cpu}


def _children_cpu() -> float:
    """CPU seconds of the ended child processes (the prepare pool is joined before ``prepare.ensure`` returns)."""
    times = os.times()
    return times.children_user + times.children_system


def table(rates: dict, args, decode: float, prepared_size: int, made: dict) -> str:
    torch_prepared = rates["PyTorch"]["prepared"]
    rows = [
        f"{args.images} PNGs of {args.size} px, prepared at {prepared_size} px, cropped to {args.crop} px, batches of "
        f"{args.batch}; images/s per core (CPU time), best of {args.repeats}",
        f"PIL decode bound: {decode:,.0f} images/s",
        "",
        f"{'pipeline':<17}{'prepared copy':>14}{'target':>9}{'PNGs':>8}{'PNGs / decode':>15}{'target':>8}",
    ]
    for name, rate in rates.items():
        target = TORCH_PREPARED_TARGET if name == "PyTorch" else torch_prepared / PREPARED_WITHIN
        rows.append(
            f"{name:<17}{rate['prepared']:>14,.0f}{f'>={target:,.0f}':>9}{rate['png']:>8,.0f}"
            f"{rate['png'] / decode:>15.2f}{f'>={PNG_SHARE_TARGET}':>8}"
        )
    rows += [
        "",
        f"prepare, {devices.cpu_cores()} processes, {made['images']} images: {made['rate']:,.0f} images/s = "
        f"{made['rate'] / decode:.2f} x one core's decode rate (target >={PREPARE_SPEEDUP_TARGET} on 2 cores)",
        f"  per CPU-second of its processes: {made['cpu_rate']:,.0f} images = {made['cpu_rate'] / decode:.2f} x decode",
    ]
    return "\n".join(rows)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--size", type=int, default=1024, help="side of the generated PNGs")
    parser.add_argument("--crop", type=int, default=224, help="IMAGE_SIZE after the random resized crop")
    parser.add_argument("--batch", type=int, default=16, help="images per batch of each framework's loader")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--root", help="where the stand-in is generated (default: the stand-in cache)")
    parser.add_argument("--readme", help="also write the table into this README's bench-loader block")
    args = parser.parse_args(argv)
    args.batch = min(args.batch, args.images)
    folder = synthetic.ensure(n_images=args.images, image_size=args.size, seed=0, root=args.root)
    paths = sorted(str(path) for path in (folder / "images").glob("*.png"))
    labels, patients = np.zeros((len(paths), params.NUM_CLASSES), np.float32), np.arange(len(paths))
    decode = per_core_rate(pil_decode_pass(paths), args.repeats)
    size = params.prepared_size(args.crop)
    with tempfile.TemporaryDirectory() as scratch:
        prepared, made = timed_prepare(paths, size, scratch)
        splits = {
            "prepared": chestxray.Split(paths, labels, patients, prepared, prepared.rows(paths)),
            "png": chestxray.Split(paths, labels, patients),
        }
        rates = {}
        for name, pipeline in PIPELINES.items():
            rates[name] = {
                path: per_core_rate(pipeline(split, args.crop, args.batch), args.repeats)
                for path, split in splits.items()
            }
    text = table(rates, args, decode, size, made)
    print(text)
    if args.readme:
        machine = f"{platform.processor() or platform.machine()}, {devices.cpu_cores()} cores"
        note = f"Produced by `make bench-loader` on {dt.date.today()} ({machine}):"
        report.replace_block(args.readme, README_START, README_END, f"{note}\n\n```\n{text}\n```")
    return {"pil_decode": decode, "prepare": made, "pipelines": rates}


if __name__ == "__main__":
    main()
