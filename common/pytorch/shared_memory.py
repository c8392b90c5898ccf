"""What a training process's data loader holds in shared memory (/dev/shm), measured, for ``docker run --shm-size``.

    python -m common.pytorch.shared_memory [--batch 256] [--size 224] [--workers 8] [--readme docker/README.md]

PyTorch's loader workers hand every batch to the training process through shared memory, and each worker keeps
``prefetch_factor`` (2) batches ready: about ``2 x workers`` batches are in /dev/shm at any moment, per training
process. It iterates one process's loader over the generated stand-in at the GPU defaults and samples /dev/shm's use,
for the uint8 gray batches the loaders send and for the float32 three-channel batches they sent before.
"""

from __future__ import annotations

import argparse
import shutil
import threading
import time
import warnings

import pandas as pd
import torch
from torchvision.transforms import v2

from common.data import chestxray, synthetic
from common.measure import report
from common.pytorch import utils as tu
from common.run import params

SHM = "/dev/shm"
README_START, README_END = "<!-- shm:start -->", "<!-- shm:end -->"


def peak_mib(loader, batches: int) -> float:
    """The most /dev/shm held above its level before, while ``batches`` batches of ``loader`` are read."""
    before, peak, done = shutil.disk_usage(SHM).used, 0, threading.Event()

    def sample():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, shutil.disk_usage(SHM).used - before)
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    for _, _ in zip(range(batches), loader, strict=False):
        time.sleep(0.05)  # a training step's time: the workers fill their prefetch while the step runs
    done.set()
    sampler.join()
    return peak / 2**20


def measure(batch: int, size: int, workers: int, batches: int) -> pd.DataFrame:
    # a GPU box's worker count on a machine with fewer cores: slower, which the peak does not depend on
    warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)
    data_dir = synthetic.ensure(n_images=1200, image_size=params.prepared_size(size))
    split = chestxray.load(data_dir, None, 0, prepared_size=params.prepared_size(size))["train"]
    drawn = batch * (batches + 2 * workers + 2)  # with replacement: enough batches from a small data set
    float_rgb = v2.Compose([tu.train_transform(size), v2.ToDtype(torch.float32, scale=True), v2.RGB()])
    rows = {}
    for name, transform in (("uint8 gray (sent now)", tu.train_transform(size)), ("float32 RGB (before)", float_rgb)):
        data = tu.ChestXrayDataset(split, transform)
        loader = torch.utils.data.DataLoader(
            data, batch_size=batch, sampler=torch.utils.data.RandomSampler(data, replacement=True, num_samples=drawn),
            num_workers=workers, prefetch_factor=2,
        )  # fmt: skip
        image = next(iter(torch.utils.data.DataLoader(tu.ChestXrayDataset(split, transform), batch_size=batch)))[0]
        rows[name] = {
            "MiB per batch": image.nbytes / 2**20,
            "peak /dev/shm MiB per process": peak_mib(loader, batches),
        }
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis(f"batch {batch}, {size} px, {workers} workers")


def main(argv=None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--batches", type=int, default=24)
    parser.add_argument("--readme", help="also write the table into this file's shm block (docker/README.md)")
    args = parser.parse_args(argv)
    table = measure(args.batch, args.size, args.workers, args.batches)
    text = report.markdown(table.round(1))
    print(text)
    if args.readme:
        note = report.produced_by(
            "bench-shm",
            f"one training process's PyTorch loader, {args.workers} workers, prefetch 2 each, reading {args.batches} "
            "batches",
        )
        report.replace_block(args.readme, README_START, README_END, f"{note}\n\n{text}")
    return table


if __name__ == "__main__":
    main()
