"""The data set prepared once for training: every image checked, shrunk to the training resolution, stored as one array.

A ChestX-ray14 PNG is 1024 x 1024 pixels; decoding one costs a core about 5 ms, so a GPU that trains 3,000 images/s
would need some 15 cores decoding for it, and checking every image before each run would cost ten minutes on a
laptop. Preparing does that work once per data set and image size: it decodes every image listed in the CSV (with the
one decode rule of :mod:`common.data.image_io`, naming every unreadable file), resizes its short side to the prepared
size and crops the centre square, and writes the pixels into ``images.u8``, one uint8 array of N x S x S on disk that
every framework reads by row (``numpy.memmap``: the operating system caches what fits, and a row is one contiguous
read). A later run trusts the prepared copy after a cheap check: the file names, sizes and modification times it was
made from, recorded in its manifest, and the size of ``images.u8`` (a full disk or a copy cut short leaves it shorter:
rebuilt with a message). The manifest also holds a sha256 of every chunk of rows, written as the chunk was prepared:
``make prepare`` (``verify=True``) reads every pixel against them, for a copy that moved between disks, and prepares
again the chunks that differ.

Nothing half-done is trusted: the manifest is written last (whole, or not at all), a prepared folder without it is
never read, and an interrupted prepare resumes where it stopped (each finished chunk of images leaves a marker).
Two prepares of the same folder at once take turns (a file lock); a stale copy (changed files, another size) is
rebuilt with a message.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np
from PIL import Image

from common.data.image_io import open_gray
from common.data.layout import cache_root
from common.errors import InputError
from common.run import devices

FORMAT = 3  # bumped when the layout or the resize rule changes: older prepared copies are then rebuilt
MANIFEST = "manifest.json"


def chunk_size(images: int) -> int:
    """Images per unit of work and of resumption: small enough to keep every core busy on a small data set, large
    enough to keep the markers few on 112,120 images."""
    return max(16, min(256, images // 64))


class Prepared:
    """A prepared copy: ``pixels(row)`` is image ``names[row]`` as a uint8 array (size x size)."""

    def __init__(self, folder: Path, names, size: int):
        self.folder, self.names, self.size = Path(folder), tuple(names), size
        self._images = None  # opened in each process that reads it (a DataLoader worker), never pickled

    def rows(self, paths: list[str]) -> np.ndarray:
        """The row of each of ``paths`` (by file name)."""
        row_of = {name: row for row, name in enumerate(self.names)}
        return np.array([row_of[Path(path).name] for path in paths], np.int64)

    def pixels(self, row: int) -> np.ndarray:
        if self._images is None:
            shape = (len(self.names), self.size, self.size)
            self._images = np.memmap(self.folder / "images.u8", np.uint8, "r", shape=shape)
        return np.array(self._images[row])  # a copy: the caller owns it, the file stays read-only

    def __getstate__(self):
        return {**self.__dict__, "_images": None}


def listing(paths: list[str]) -> str:
    """A digest of what the copy is made from: every file's name, size and modification time (a stat, no decode)."""
    digest = hashlib.sha256()
    for path in paths:
        stat = os.stat(path)
        digest.update(f"{Path(path).name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def folder_for(data_dir, size: int) -> Path:
    """Next to the data when its folder is writable (deleting the data deletes the copy), else in the user's cache."""
    data_dir = Path(data_dir).resolve()
    if os.access(data_dir, os.W_OK):
        return data_dir / ".prepared" / f"{size}px"
    tag = hashlib.sha256(str(data_dir).encode()).hexdigest()[:12]
    return cache_root() / "prepared" / f"{data_dir.name}-{tag}" / f"{size}px"


def find(data_dir, paths: list[str], size: int) -> Prepared | None:
    """The valid prepared copy of ``paths`` at ``size``, or None: missing, unfinished, made from other files, or with
    an ``images.u8`` of another length than its manifest says."""
    folder = folder_for(data_dir, size)
    manifest = _read_json(folder / MANIFEST)
    if manifest is None or not _matches(manifest, paths, size) or _length_problem(folder, len(paths), size):
        return None
    return Prepared(folder, tuple(manifest["names"]), size)


def ensure(data_dir, paths: list[str], size: int, workers: int | None = None, verify: bool = False) -> Prepared:
    """The prepared copy of ``paths`` at ``size``: the valid one, or one made now (with a progress bar); with
    ``verify``, every pixel of a valid one is also checked against the manifest's chunk digests, and the chunks that
    differ are prepared again.

    Raises :class:`InputError` naming the unreadable images, and writes no manifest then.
    """
    found = find(data_dir, paths, size)
    if found is not None and not verify:
        return found
    folder = folder_for(data_dir, size)
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder):
        found = find(data_dir, paths, size)  # another process may have finished it while this one waited
        if found is not None and verify:
            differing = _differing_chunks(folder, len(paths), size)
            if differing:
                print(
                    f"{folder}/images.u8 differs from the digests it was prepared with in {len(differing)} chunk(s) "
                    f"of {chunk_size(len(paths))} images (rows {', '.join(str(start) for start in differing[:5])}"
                    f"{' ...' if len(differing) > 5 else ''}): preparing them again.",
                    flush=True,
                )
                for start in differing:
                    (folder / "done" / f"{start:09d}").unlink(missing_ok=True)
                found = None
        if found is not None:
            return found
        return _build(folder, paths, size, workers or devices.cpu_cores())


def _length_problem(folder: Path, images: int, size: int) -> str | None:
    """Why ``images.u8`` cannot hold ``images`` rows of ``size`` x ``size``, or None when its length is right."""
    expected = images * size * size
    try:
        actual = (folder / "images.u8").stat().st_size
    except OSError:
        return "images.u8 is missing"
    if actual == expected:
        return None
    return f"images.u8 holds {actual:,} bytes where {images:,} images of {size} x {size} px take {expected:,}"


def _digest(images: np.ndarray, start: int, count: int) -> str:
    return hashlib.sha256(images[start : start + count].tobytes()).hexdigest()


def _differing_chunks(folder: Path, images: int, size: int) -> list[int]:
    """The first rows of the chunks whose pixels no longer match the digests in the manifest."""
    digests = _read_json(folder / MANIFEST)["digests"]
    pixels = np.memmap(folder / "images.u8", np.uint8, "r", shape=(images, size, size))
    chunk = chunk_size(images)
    return [start for start in range(0, images, chunk) if _digest(pixels, start, chunk) != digests[str(start)]]


def _matches(manifest: dict, paths: list[str], size: int) -> bool:
    return (
        manifest.get("format") == FORMAT
        and manifest.get("size") == size
        and manifest.get("names") == [Path(path).name for path in paths]
        and manifest.get("listing") == listing(paths)
    )


@contextlib.contextmanager
def _locked(folder: Path):
    """An exclusive lock on ``folder``: a second prepare of it waits, then finds the first one's copy."""
    with open(folder / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"Another process is preparing {folder}; waiting for it ...", flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield  # closing the file releases the lock


def _build(folder: Path, paths: list[str], size: int, workers: int) -> Prepared:
    from tqdm import tqdm  # the text bar, as in the notebooks: tqdm.auto warns in a notebook without ipywidgets

    from common.measure.results import atomic_write  # here, not at the top: the spawned workers need not import pandas

    plan = {"format": FORMAT, "size": size, "names": [Path(path).name for path in paths], "listing": listing(paths)}
    chunk = chunk_size(len(paths))
    stale = _read_json(folder / MANIFEST)
    (folder / MANIFEST).unlink(missing_ok=True)  # first: from here on the folder is not trusted
    shortened = (folder / "images.u8").exists() and _length_problem(folder, len(paths), size)
    if _read_json(folder / "plan.json") != plan or shortened:  # what was done does not count
        if shortened:  # a full disk, or a copy cut short: which rows survived cannot be told
            print(f"{folder}: {shortened} (a full disk, or a copy cut short?): rebuilding it.")
        elif stale is not None:
            print(f"{folder} was prepared from other files or at another size: rebuilding it.")
        shutil.rmtree(folder / "done", ignore_errors=True)
        (folder / "images.u8").unlink(missing_ok=True)
        atomic_write(folder / "plan.json", lambda file: json.dump(plan, file))
    _check_free_space(folder, len(paths) * size * size)
    shape = (len(paths), size, size)
    np.memmap(folder / "images.u8", np.uint8, "r+" if (folder / "images.u8").exists() else "w+", shape=shape).flush()
    (folder / "done").mkdir(exist_ok=True)
    chunks = [start for start in range(0, len(paths), chunk) if not (folder / "done" / f"{start:09d}").exists()]
    unreadable: list[str] = []
    if chunks:
        to_go = sum(len(paths[start : start + chunk]) for start in chunks)
        print(
            f"Preparing {len(paths):,} images at {size} px in {folder} ({to_go:,} to go, {workers} processes); "
            "interrupted, it resumes where it stopped.",
            flush=True,
        )
        # on standard output, as the training bars: a notebook shows standard error in red, like a warning
        shown = dict(unit="image", desc="prepare", mininterval=2, file=sys.stdout)
        with (
            ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool,
            tqdm(total=len(paths), initial=len(paths) - to_go, **shown) as bar,
        ):
            futures = [
                pool.submit(_prepare_chunk, str(folder), shape, start, paths[start : start + chunk]) for start in chunks
            ]
            for future in futures:
                start, failed, digest = future.result()
                if failed:
                    unreadable += failed
                else:  # the marker keeps the chunk's digest for the manifest, across interruptions
                    (folder / "done" / f"{start:09d}").write_text(digest)
                bar.update(min(chunk, len(paths) - start))
    if unreadable:
        more = f"\n  ... and {len(unreadable) - 10} more" if len(unreadable) > 10 else ""
        raise InputError(
            f"{len(unreadable)} image(s) cannot be read, so the data set was not prepared (what was read is kept for "
            "the next attempt):\n  " + "\n  ".join(unreadable[:10]) + more
        )
    with open(folder / "images.u8", "rb+") as file:
        os.fsync(file.fileno())  # the pixels reach the disk before the manifest says they are there
    digests = {str(start): (folder / "done" / f"{start:09d}").read_text() for start in range(0, len(paths), chunk)}
    atomic_write(folder / MANIFEST, lambda file: json.dump({**plan, "digests": digests}, file))
    return Prepared(folder, tuple(plan["names"]), size)


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _check_free_space(folder: Path, needed: int) -> None:
    images = folder / "images.u8"
    have = shutil.disk_usage(folder).free + (images.stat().st_size if images.exists() else 0)
    if have < needed:
        raise InputError(
            f"Preparing needs {needed / 2**30:.1f} GiB in {folder}, which has {have / 2**30:.1f} GiB free: free some "
            "space, or set PREPARED=False to read the PNG files directly (slower)."
        )


def _prepare_chunk(
    folder: str, shape: tuple[int, int, int], start: int, paths: list[str]
) -> tuple[int, list[str], str]:
    """Decode, shrink and store ``paths`` as rows ``start...``; returns the unreadable ones, each with its error, and
    the digest of the rows written."""
    images = np.memmap(Path(folder) / "images.u8", np.uint8, "r+", shape=shape)
    size, failed = shape[1], []
    for row, path in enumerate(paths, start):
        try:
            images[row] = shrink(open_gray(path), size)
        except InputError as error:  # it names the file and what is wrong with it
            failed.append(str(error))
    images.flush()
    return start, failed, _digest(images, start, len(paths))


def shrink(image: Image.Image, size: int) -> np.ndarray:
    """The short side resized to ``size``, then the centre square: the prepared form of an image.

    ``reducing_gap=1`` first averages whole blocks of pixels (1024 to 256 px: each 4 x 4 block, a box filter that
    antialiases), then resizes what is left: the resize then costs next to nothing beside the decode.
    """
    width, height = image.size
    scale = size / min(width, height)
    target = (max(size, round(width * scale)), max(size, round(height * scale)))
    resized = image.resize(target, Image.BILINEAR, reducing_gap=1.0)
    left, top = (resized.width - size) // 2, (resized.height - size) // 2
    return np.array(resized.crop((left, top, left + size, top + size)))  # writable, as a row of the copy is
