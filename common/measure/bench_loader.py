"""Benchmark of every framework's training input pipeline, in images per second per core.

    python -m common.measure.bench_loader [--images 64] [--size 1024] [--crop 224] [--batch 16] [--pass-images 512]
                                          [--readme README.md]

Run from the tools environment (``make bench-loader``); each framework's pipeline is timed by a process of its own
environment's Python (``--pipeline``), so a framework whose environment is not installed gets a row that says so.

On a generated stand-in of the real images' size (1024 px), prepared once at ``params.prepared_size(crop)``, it
times on one core:
  1. a plain PIL decode loop: the bound of any pipeline that reads PNGs (none decodes faster than libpng), and the
     same with the prepare step's shrink, the bound of the PNG path before its crop;
  2. each framework's training pipeline (read + random resized crop + flip, batched by its own loader with no worker
     process and one thread; every framework normalizes on its devices, so the pipelines end at the uint8 gray crop),
     once from the prepared copy and once from the PNGs (decoded and shrunk to the prepared size as ``PREPARED=False``
     does, so both give the same pixels). A pass lists the images over again up to ``--pass-images``: what a pipeline
     spends once per pass (TensorFlow starts its iterator's threads and buffers in about 20 ms) then weighs per image
     about as little as in an epoch of the real data set;
and, with every core, ``prepare.ensure`` building a fresh prepared copy.

A rate per core is images per CPU-second of this process, all its threads together: a pipeline that spreads over
more threads than asked is not counted as faster, and other processes sharing the cores do not slow it down.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import tempfile
import time
from pathlib import Path

THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
if __name__ == "__main__":  # numpy's BLAS, MXNet and TensorFlow size their thread pools on import: one thread each
    os.environ.update(dict.fromkeys(THREAD_VARIABLES, "1"))

import numpy as np  # noqa: E402

from common.data import chestxray, prepare, synthetic  # noqa: E402
from common.measure import report  # noqa: E402
from common.run import devices, params  # noqa: E402
from common.run.environments import ENVIRONMENTS, setup_command  # noqa: E402

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

    from common.pytorch import utils as torch_utils

    torch.set_num_threads(1)
    dataset = torch_utils.ChestXrayDataset(split, torch_utils.train_transform(crop))
    data = torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=True, drop_last=True, num_workers=0)
    return lambda: sum(len(images) for images, _, _ in data)


def tensorflow_pass(split, crop: int, batch: int):
    from common.tensorflow import utils as tf_utils
    from common.tensorflow.imports import tf

    try:
        tf.config.set_visible_devices([], "GPU")  # a pipeline on the host: no GPU memory taken from a training run
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
    from common.mxnet import imports as mxnet_import

    mxnet_import.load(threads=1)
    from common.mxnet import utils as gluon_utils

    data = gluon_utils.loader(split, crop, batch, training=True, workers=0)
    return lambda: sum(images.shape[0] for images, _ in data)


def chainer_pass(split, crop: int, batch: int):
    from common.chainer import utils as chainer_utils
    from common.chainer.imports import chainer

    images = chainer_utils.ChestXrayImages(split, range(len(split)), crop, seed=0)
    epoch = chainer_utils.TrainingEpochs(images, batch, epochs=1)

    def one_pass():
        batches = chainer.iterators.SerialIterator(epoch, batch, repeat=False, shuffle=False)
        return sum(len(chainer.dataset.concat_examples(items)[0]) for items in batches)

    return one_pass


# Each pipeline, and the environment whose Python times it.
PIPELINES = {
    "PyTorch": ("pytorch", torch_pass),
    "TensorFlow/Keras": ("tensorflow", tensorflow_pass),
    "Gluon": ("mxnet-chainer", gluon_pass),
    "Chainer": ("mxnet-chainer", chainer_pass),
}


def time_pipeline(name: str, spec: dict) -> dict[str, float]:
    """In ``name``'s environment: its rates per core from the prepared copy and from the PNGs that ``spec`` names."""
    prepared = prepare.find(spec["prepared_from"], spec["paths"] * spec["copies"], spec["size"])
    paths = spec["paths"] * math.ceil(spec["pass_images"] / len(spec["paths"]))
    labels, patients = np.zeros((len(paths), params.NUM_CLASSES), np.float32), np.arange(len(paths))
    splits = {
        "prepared": chestxray.Split(paths, labels, patients, prepared, prepared.rows(paths)),
        "png": chestxray.Split(paths, labels, patients, size=spec["size"]),
    }
    _, pipeline = PIPELINES[name]
    return {
        path: per_core_rate(pipeline(split, spec["crop"], spec["batch"]), spec["repeats"])
        for path, split in splits.items()
    }


def in_environment(name: str, spec: dict, scratch: Path) -> dict[str, float] | None:
    """``time_pipeline`` run by the Python of ``name``'s environment; None when that environment is not installed."""
    env = ENVIRONMENTS[PIPELINES[name][0]]
    if not env.installed:
        return None
    spec_file = scratch / "spec.json"
    spec_file.write_text(json.dumps(spec))
    command = [str(env.python), "-m", "common.measure.bench_loader", "--pipeline", name, "--spec", str(spec_file)]
    one_thread = dict.fromkeys(THREAD_VARIABLES, "1")
    out = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **one_thread})
    if out.returncode != 0:
        raise RuntimeError(f"the {name} pipeline failed in the {env.name} environment:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def pil_decode_pass(paths):
    from PIL import Image

    def one_pass():
        for path in paths:
            with Image.open(path) as image:
                image.load()
        return len(paths)

    return one_pass


def shrink_pass(paths, size: int):
    """The decode and the prepare step's shrink: what ``PREPARED=False`` does to each PNG before any crop."""
    from common.data.image_io import open_gray

    def one_pass():
        for path in paths:
            prepare.shrink(open_gray(path), size)
        return len(paths)

    return one_pass


def timed_prepare(paths: list[str], size: int, folder) -> tuple[prepare.Prepared, dict]:
    """A fresh prepared copy in ``folder`` made with every core; returns it and what it took: ``images``, ``rate`` (per
    second of wall time) and ``cpu_rate`` (per CPU-second of its processes, their start-up included).

    A prepare of the whole data set spends seconds starting its processes and hours decoding; a small stand-in would
    time mostly the start: its files are listed as many times as it takes to give every core 2,048 images.
    """
    cores = devices.cpu_cores()
    copies = math.ceil(2048 * cores / len(paths))
    listed = paths * copies
    start, children = time.perf_counter(), _children_cpu()
    prepared = prepare.ensure(folder, listed, size, workers=cores)
    wall, cpu = time.perf_counter() - start, _children_cpu() - children
    return prepared, {
        "images": len(listed),
        "copies": copies,
        "rate": len(listed) / wall,
        "cpu_rate": len(listed) / cpu,
    }


def _children_cpu() -> float:
    """CPU seconds of the ended child processes (the prepare pool is joined before ``prepare.ensure`` returns)."""
    times = os.times()
    return times.children_user + times.children_system


def table(rates: dict, args, decode: float, shrunk: float, prepared_size: int, made: dict) -> str:
    torch_prepared = (rates["PyTorch"] or {}).get("prepared")
    rows = [
        f"{args.images} PNGs of {args.size} px, prepared at {prepared_size} px, cropped to {args.crop} px, batches of "
        f"{args.batch}, {math.ceil(args.pass_images / args.images) * args.images} images a pass; images/s per core "
        f"(CPU time), best of {args.repeats} passes",
        f"PIL decode bound: {decode:,.0f} images/s; decoded and shrunk to {prepared_size} px (no crop yet): "
        f"{shrunk:,.0f} = {shrunk / decode:.2f} x decode",
        "",
        f"{'pipeline':<17}{'prepared copy':>14}{'target':>9}{'PNGs':>8}{'PNGs / decode':>15}{'target':>8}",
    ]
    for name, rate in rates.items():
        if rate is None:
            environment = PIPELINES[name][0]
            missing = f"the {environment} environment is not installed ({setup_command(environment)})"
            rows.append(f"{name:<17}not measured: {missing}")
            continue
        relative = name != "PyTorch" and torch_prepared is not None
        target = torch_prepared / PREPARED_WITHIN if relative else TORCH_PREPARED_TARGET
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
    parser.add_argument("--pass-images", type=int, default=512, help="images per timed pass (the PNGs listed again)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--root", help="where the stand-in is generated (default: the stand-in cache)")
    parser.add_argument("--readme", help="also write the table into this README's bench-loader block")
    parser.add_argument("--pipeline", choices=PIPELINES, help=argparse.SUPPRESS)  # one pipeline, in its environment
    parser.add_argument("--spec", help=argparse.SUPPRESS)  # what it times, written by the tools' process
    args = parser.parse_args(argv)
    if args.pipeline:
        rates = time_pipeline(args.pipeline, json.loads(Path(args.spec).read_text()))
        print(json.dumps(rates))
        return rates
    args.batch = min(args.batch, args.images)
    folder = synthetic.ensure(n_images=args.images, image_size=args.size, seed=0, root=args.root)
    paths = sorted(str(path) for path in (folder / "images").glob("*.png"))
    decode = per_core_rate(pil_decode_pass(paths), args.repeats)
    size = params.prepared_size(args.crop)
    shrunk = per_core_rate(shrink_pass(paths, size), args.repeats)
    with tempfile.TemporaryDirectory() as scratch:
        _, made = timed_prepare(paths, size, scratch)
        spec = {"paths": paths, "prepared_from": scratch, "copies": made["copies"], "size": size, "crop": args.crop,
                "batch": args.batch, "repeats": args.repeats, "pass_images": args.pass_images}  # fmt: skip
        rates = {name: in_environment(name, spec, Path(scratch)) for name in PIPELINES}
    text = table(rates, args, decode, shrunk, size, made)
    print(text)
    if args.readme:
        note = report.produced_by("bench-loader")
        report.replace_block(args.readme, README_START, README_END, f"{note}\n\n```\n{text}\n```")
    return {"pil_decode": decode, "decode_and_shrink": shrunk, "prepare": made, "pipelines": rates}


if __name__ == "__main__":
    main()
