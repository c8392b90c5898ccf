"""The training loop the experiment notebooks share: PyTorch_MultiGPU-Exp-Loss and PyTorch_ModelParallel.

Those notebooks compare ways of placing one model on several devices; the loop, the data
shards and the learning-rate schedule stay the same for every way, so only the placement
differs. ``PyTorch_MultiGPU`` keeps its DDP loop written out in the notebook, as its lesson.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler
from tqdm import tqdm

from common.errors import InputError
from common.measure.phases import BatchWait, Phases
from common.pytorch import utils as tu
from common.run import params


def sharded_loader(split, transform, batch_size: int, process: tu.Process, *, shuffle: bool, seed: int, workers: int):
    """This process's share of ``split`` (all of it in a single process); evaluation pads shards to equal length."""
    data = tu.ChestXrayDataset(split, transform)
    sampler = DistributedSampler(
        data, num_replicas=process.world_size, rank=process.rank, shuffle=shuffle, seed=seed, drop_last=False
    )
    return DataLoader(
        data,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=shuffle,
        num_workers=workers,
        persistent_workers=workers > 0,
        pin_memory=process.device.type == "cuda",
    )


def warmup_cosine(optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The rate of every notebook over ``steps`` updates (:func:`common.run.params.schedule_factor`): up from 0 over
    the warmup, then down a cosine to 0; call its ``step()`` after every ``optimizer.step()``."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(params.schedule_factor, steps=steps))


def fit(
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    loader,
    optimizer,
    epochs: int,
    process: tu.Process,
    *,
    label: str = "",
    phases: Phases | None = None,
) -> dict[str, list[float]]:
    """Train for ``epochs``; ``step(images, labels)`` takes one optimizer step on a batch of ``loader`` and returns
    its loss without waiting for it; the learning rate follows the schedule of every notebook.

    Returns the seconds, the mean training loss (averaged over processes) and the seconds spent waiting for the
    input pipeline of each epoch; ``phases`` gets each epoch's ``train`` phase.
    """
    scheduler = warmup_cosine(optimizer, epochs * len(loader))
    history = {"epoch_seconds": [], "train_loss": [], "data_wait_seconds": []}
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        running = torch.zeros((), device=process.device)
        batches = BatchWait(loader)
        start = time.time()
        description = f"{label} epoch {epoch + 1}/{epochs}".strip()
        for images, labels, _ in tqdm(
            batches, desc=description, disable=not process.is_main, mininterval=2, file=sys.stdout
        ):
            running += step(images, labels)
            scheduler.step()
        if process.world_size > 1:
            dist.all_reduce(running)  # also waits for every rank, so the timing covers the slowest
        end = time.time()
        if phases is not None:
            phases.add("train", start, end, epoch + 1)
        history["epoch_seconds"].append(end - start)
        history["train_loss"].append(running.item() / process.world_size / len(loader))
        history["data_wait_seconds"].append(batches.seconds)
    return history


def reset_peak_memory(device_indices) -> None:
    for index in device_indices:
        torch.cuda.reset_peak_memory_stats(index)


def peak_memory_mib(device_indices) -> dict[str, float]:
    """Peak memory PyTorch allocated on each CUDA device since the last reset (empty on the CPU)."""
    return {f"cuda:{i}": torch.cuda.max_memory_allocated(i) / 2**20 for i in device_indices}


PLACEMENTS = ("dp-gather", "dp-replica-loss", "ddp")
DATA_PARALLEL = ("dp-gather", "dp-replica-loss")


def choose_placements(requested, hardware) -> tuple[list[str], dict[str, str]]:
    """The placements to run (the ``WAYS`` parameter; None: all this machine can measure) and what it cannot measure.

    ``nn.DataParallel`` splits a batch over two or more GPUs; anywhere else it runs the
    plain model on one device, so asking for it there is refused rather than mismeasured.
    """
    multi_gpu = hardware.kind == "gpu" and hardware.count > 1
    not_measured = {}
    if not multi_gpu:
        not_measured[" and ".join(DATA_PARALLEL)] = (
            f"nn.DataParallel needs 2 or more GPUs; on {hardware.describe()} it would run the plain model on one device"
        )
    if hardware.kind == "cpu":
        not_measured["peak memory per device and imbalance"] = (
            "simulated CPU devices share one memory: only the whole machine's is measured (device_utilization)"
        )
    elif hardware.count < 2:
        not_measured["imbalance"] = "needs 2 or more GPUs"
    if requested is None:
        return (list(PLACEMENTS) if multi_gpu else ["ddp"]), not_measured
    if isinstance(requested, str) or not all(isinstance(way, str) for way in requested) or not requested:
        raise InputError(f"WAYS must be None or a non-empty list of names from {PLACEMENTS}, got {requested!r}.")
    unknown = sorted(set(requested) - set(PLACEMENTS))
    if unknown:
        raise InputError(f"WAYS names unknown way(s) {', '.join(unknown)}: choose among {', '.join(PLACEMENTS)}.")
    if not multi_gpu and set(requested) & set(DATA_PARALLEL):
        raise InputError(
            f"WAYS={list(requested)} asks for nn.DataParallel, which needs 2 or more GPUs and this run has "
            f"{hardware.describe()}: leave WAYS=None (DDP only here), or run on a machine with several GPUs."
        )
    skipped = [way for way in PLACEMENTS if way not in requested and (multi_gpu or way == "ddp")]
    if skipped:
        not_measured[" and ".join(skipped)] = "not requested (WAYS)"
    return [way for way in PLACEMENTS if way in requested], not_measured
