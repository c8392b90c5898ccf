"""Benchmark of the training input pipeline, in images per second on one core.

    python -m common.bench_loader [--images 64] [--size 1024] [--crop 224] [--readme README.md]

Times, on generated PNGs of the real data set's size (1024 px), one process
with one thread:
  1. a plain PIL decode loop (the floor: no input pipeline decodes faster than libpng),
  2. the training pipeline of the PyTorch notebooks: that decode + random resized
     crop + flip + normalize (torchvision transforms v2 on a uint8 tensor), as
     ``common.torch_utils.ChestXrayDataset`` runs it.
Their ratio says how much of the pipeline's time goes to decoding alone.
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import time

from PIL import Image

from common import devices, report, synthetic
from common.params import NUM_CLASSES

README_START, README_END = "<!-- bench-loader:start -->", "<!-- bench-loader:end -->"


def best_rate(function, items, repeats: int) -> float:
    """Images per second of the fastest of ``repeats`` passes over ``items``."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for item in items:
            function(item)
        best = min(best, time.perf_counter() - start)
    return len(items) / best


def main(argv=None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--size", type=int, default=1024, help="side of the generated PNGs")
    parser.add_argument("--crop", type=int, default=224, help="IMAGE_SIZE after the random resized crop")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--readme", help="also write the figures into this README's bench-loader block")
    args = parser.parse_args(argv)

    import torch

    from common import torch_utils

    torch.set_num_threads(1)
    folder = synthetic.ensure(n_images=args.images, image_size=args.size, seed=0)
    paths = sorted(str(path) for path in (folder / "images").glob("*.png"))
    labels = torch.zeros(len(paths), NUM_CLASSES)
    dataset = torch_utils.ChestXrayDataset(paths, labels, torch_utils.train_transform(args.crop))

    def pil_decode(path):
        with Image.open(path) as image:
            image.load()

    decode = best_rate(pil_decode, paths, args.repeats)
    pipeline = best_rate(dataset.__getitem__, range(len(dataset)), args.repeats)
    lines = [
        f"{len(paths)} PNGs of {args.size} px, one core, best of {args.repeats}:",
        f"  PIL decode only                        {decode:8.1f} images/s",
        f"  training pipeline (decode..normalize)  {pipeline:8.1f} images/s  (crop to {args.crop} px)",
        f"  pipeline / decode-only                 {pipeline / decode:8.2f}",
    ]
    print("\n".join(lines))
    if args.readme:
        machine = f"{platform.processor() or platform.machine()}, {devices.cpu_cores()} cores"
        note = f"Produced by `make bench-loader` on {dt.date.today()} ({machine}):"
        report.replace_block(args.readme, README_START, README_END, f"{note}\n\n```\n" + "\n".join(lines) + "\n```")
    return {"pil_decode": decode, "pipeline": pipeline, "ratio": pipeline / decode}


if __name__ == "__main__":
    main()
