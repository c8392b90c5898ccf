"""``python -m common.data prepare DATA_DIR [--image-size 224]`` (``make prepare``): check every image of a
ChestX-ray14 folder once and write the copy that every notebook trains from; a copy already there has every pixel
checked against the digests it was written with (a copy moved between disks), and what differs is prepared again."""

from __future__ import annotations

import argparse
import time

from common.data import chestxray, prepare
from common.errors import InputError
from common.run import devices, params


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    prepare_command = commands.add_parser("prepare", help="prepare a folder for training at one image size")
    prepare_command.add_argument("data_dir", help="a ChestX-ray14 folder (Data_Entry_2017.csv and the images)")
    prepare_command.add_argument(
        "--image-size", type=int, default=params.GPU_DEFAULTS.IMAGE_SIZE, help="IMAGE_SIZE to train at"
    )
    prepare_command.add_argument(
        "--workers", type=int, default=devices.cpu_cores(), help="processes (default: every core)"
    )
    args = parser.parse_args(argv)
    size = params.prepared_size(args.image_size)
    paths = chestxray.locate_images(args.data_dir, chestxray.read_entries(args.data_dir)["Image Index"].tolist())
    start = time.perf_counter()
    prepared = prepare.ensure(args.data_dir, paths, size, args.workers, verify=True)
    seconds = time.perf_counter() - start
    print(f"{prepared.folder}: {len(prepared.names):,} images at {size} px, ready in {seconds:.1f} s")


if __name__ == "__main__":
    try:
        main()
    except InputError as error:
        raise SystemExit(f"error: {error}") from None
