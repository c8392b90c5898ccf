"""NIH ChestX-ray14 as every notebook sees it: labels, a patient-level split, checked files.

The folder layout is the one NIH publishes: ``Data_Entry_2017.csv``, the PNG
files in ``images/`` (or in the ``images_001/images`` ... folders of the
archive), and optionally the official ``train_val_list.txt`` / ``test_list.txt``.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from PIL import Image

from common.data import prepare
from common.data.image_io import open_gray, read_gray
from common.data.layout import CSV_NAME, NO_FINDING, TEST_LIST, TRAIN_VAL_LIST
from common.data.prepare import Prepared
from common.errors import InputError
from common.run import params
from common.run.params import FINDINGS, TEST_SHARE, VALID_SHARE

REQUIRED_COLUMNS = ("Image Index", "Finding Labels", "Patient ID")
SPLIT_NAMES = ("train", "valid", "test")


@dataclass
class Split:
    """One part of the data: image paths, multi-hot labels (n x 14), patient ids, and where the pixels come from.

    With a prepared copy (:mod:`common.data.prepare`) ``rows`` are the images' rows in it; without, each image is
    decoded from its PNG and, with ``size``, shrunk as the prepare step shrinks it (:func:`common.data.prepare.shrink`),
    so both give the same pixels. Every framework's input pipeline reads pixels through :meth:`pixels`.
    """

    paths: list[str]
    labels: np.ndarray
    patients: np.ndarray
    prepared: Prepared | None = None
    rows: np.ndarray | None = None
    size: int | None = None  # the side of the images :meth:`pixels` gives (a PNG is shrunk to it); None: as decoded

    def __post_init__(self):
        if self.prepared is not None:
            self.size = self.prepared.size

    def __len__(self) -> int:
        return len(self.paths)

    def pixels(self, index: int) -> np.ndarray:
        """Image ``index`` as gray uint8 pixels: its row of the prepared copy, or its PNG decoded (and shrunk)."""
        if self.prepared is not None:
            return self.prepared.pixels(int(self.rows[index]))
        if self.size is None:
            return read_gray(self.paths[index])
        return prepare.shrink(open_gray(self.paths[index]), self.size)

    def prevalence(self) -> pd.Series:
        return pd.Series(self.labels.mean(axis=0), index=list(FINDINGS), name="prevalence")


def read_entries(data_dir) -> pd.DataFrame:
    """Read and check ``Data_Entry_2017.csv``; raise :class:`InputError` on anything a user must fix."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise InputError(
            f"Data folder {data_dir} does not exist: set DATA_DIR to a ChestX-ray14 folder "
            f"(with {CSV_NAME} and images/), or to None to generate the stand-in data set."
        )
    csv = data_dir / CSV_NAME
    if not csv.is_file():
        raise InputError(
            f"{csv} is missing: DATA_DIR must contain the NIH label file {CSV_NAME} "
            f"next to the images/ folder (or set DATA_DIR=None to generate the stand-in data set)."
        )
    try:
        entries = pd.read_csv(csv)
    except (pd.errors.EmptyDataError, pd.errors.ParserError, UnicodeDecodeError) as error:
        raise InputError(
            f"{csv} is not a readable CSV ({error}): use the unmodified {CSV_NAME} from the NIH release."
        ) from None
    missing = [column for column in REQUIRED_COLUMNS if column not in entries.columns]
    if missing:
        has = ", ".join(map(repr, entries.columns))
        raise InputError(
            f"{csv} lacks the column(s) {', '.join(map(repr, missing))} (it has {has}): "
            f"use the unmodified {CSV_NAME} from the NIH release."
        )
    labels = entries["Finding Labels"].fillna("").astype(str)
    known = set(FINDINGS) | {NO_FINDING}
    seen = {label for cell in labels for label in cell.split("|")}
    unknown = sorted(seen - known)
    if unknown:
        row = next(i for i, cell in enumerate(labels) if set(cell.split("|")) & set(unknown))
        raise InputError(
            f"{csv} has unknown finding label(s) {', '.join(map(repr, unknown))} "
            f"(first in {entries['Image Index'].iloc[row]!r}): labels must be among {', '.join(FINDINGS)} "
            f"or {NO_FINDING!r}, separated by '|'. Fix the spelling or drop those rows."
        )
    return entries


def multi_hot(finding_labels: pd.Series) -> np.ndarray:
    """``"Effusion|Mass"`` -> 1 at those two findings; ``"No Finding"`` -> all zeros."""
    index = {name: i for i, name in enumerate(FINDINGS)}
    out = np.zeros((len(finding_labels), len(FINDINGS)), dtype=np.float32)
    for row, cell in enumerate(finding_labels):
        for label in str(cell).split("|"):
            if label in index:
                out[row, index[label]] = 1.0
    return out


def locate_images(data_dir, names) -> list[str]:
    """Full paths of the named images, in ``images/`` or anywhere below ``data_dir``."""
    data_dir = Path(data_dir)
    flat = data_dir / "images"
    if flat.is_dir() and all((flat / name).is_file() for name in names):
        return [str(flat / name) for name in names]
    found = {}
    for root, _, files in os.walk(data_dir):
        for file in files:
            if file.endswith(".png"):
                found.setdefault(file, os.path.join(root, file))
    missing = [name for name in names if name not in found]
    if missing:
        raise InputError(
            f"{len(missing)} image(s) listed in {CSV_NAME} are not under {data_dir} (first: {missing[0]}): "
            f"extract all images_*.tar.gz archives into {flat}, or set MAX_IMAGES to use part of the data."
        )
    return [found[name] for name in names]


def _check_image(path: str) -> str | None:
    try:
        with Image.open(path) as image:
            image.load()  # a full decode: verify() alone misses truncated pixel data
    except Exception as error:  # PIL raises several types for bad files
        return f"{path} ({type(error).__name__}: {error})"
    return None


def check_images(paths, workers: int | None = None) -> None:
    """Decode every image once, before training, and name the first unreadable file."""
    with ThreadPoolExecutor(max_workers=workers or min(8, os.cpu_count() or 1)) as pool:
        for problem in pool.map(_check_image, paths, chunksize=64):
            if problem:
                raise InputError(
                    f"Cannot read image {problem}: the file is damaged or truncated. "
                    f"Replace it from the NIH release, or remove its row from {CSV_NAME}."
                )


def _read_list(path: Path) -> set[str]:
    return {line.strip() for line in path.read_text().splitlines() if line.strip()}


def split_patients(patients: np.ndarray, fractions: tuple[float, float, float], seed: int) -> np.ndarray:
    """Assign every patient to train, valid or test; all images of a patient go together."""
    unique = np.unique(patients)
    order = np.random.default_rng(seed).permutation(unique)
    bounds = np.cumsum(fractions)[:-1] / np.sum(fractions) * len(order)
    part_of = {}
    for part, group in enumerate(np.split(order, bounds.round().astype(int))):
        part_of.update(dict.fromkeys(group.tolist(), part))
    return np.array([SPLIT_NAMES[part_of[p]] for p in patients.tolist()])


def assign_splits(
    entries: pd.DataFrame, data_dir, seed: int, valid_fraction: float = VALID_SHARE, test_fraction: float = TEST_SHARE
):
    """The split of every row: the official lists when present, a seeded patient-level split otherwise.

    With the official lists, ``test`` is ``test_list.txt`` and ``valid`` is a
    patient-level share of ``train_val_list.txt``.
    """
    data_dir = Path(data_dir)
    patients = entries["Patient ID"].to_numpy()
    if (data_dir / TRAIN_VAL_LIST).is_file() and (data_dir / TEST_LIST).is_file():
        test_names = _read_list(data_dir / TEST_LIST)
        is_test = entries["Image Index"].isin(test_names).to_numpy()
        parts = np.full(len(entries), "test", dtype=object)
        train_val = ~is_test
        share = valid_fraction / (1.0 - test_fraction)
        parts[train_val] = split_patients(patients[train_val], (1.0 - share, share, 0.0), seed)
        return parts.astype(str), "official lists"
    fractions = (1.0 - valid_fraction - test_fraction, valid_fraction, test_fraction)
    return split_patients(patients, fractions, seed), f"seeded patient split {fractions}"


def subsample_patients(entries: pd.DataFrame, max_images: int | None, seed: int) -> pd.DataFrame:
    """At most ``max_images`` rows, drawn by whole patients so that no patient is cut in two."""
    if max_images is None or max_images >= len(entries):
        return entries
    patients = entries["Patient ID"].to_numpy()
    order = np.random.default_rng(seed).permutation(np.unique(patients))
    counts = entries.groupby("Patient ID").size()
    kept = order[np.cumsum(counts.loc[order].to_numpy()) <= max_images]
    return entries[entries["Patient ID"].isin(kept)]


def load(
    data_dir,
    max_images: int | None = None,
    seed: int = 0,
    check: bool = True,
    prepared_size: int | None = None,
    prepared: bool = True,
) -> dict[str, Split]:
    """Read, check and split a ChestX-ray14 folder: ``{"train": Split, "valid": Split, "test": Split}``.

    Every problem a user can fix (missing files, bad labels, unreadable images) is raised here, before any
    training time is spent. With ``prepared_size``, the splits read the prepared copy of the whole folder at that
    size, made now if it is missing or stale (which checks every image) and trusted after a cheap check otherwise;
    ``check=False`` (a launched training process) only opens it. ``prepared=False`` (the notebooks' ``PREPARED``)
    decodes each PNG whenever it is read instead and shrinks it to ``prepared_size`` there: the same pixels, at a
    decode's cost every epoch. Without a copy, ``check`` decodes every image once.
    """
    entries = read_entries(data_dir)
    copy = _prepared(data_dir, entries, prepared_size, make=check) if prepared_size and prepared else None
    entries = subsample_patients(entries, max_images, seed).reset_index(drop=True)
    paths = locate_images(data_dir, entries["Image Index"].tolist())
    if check and copy is None:
        check_images(paths)
    parts, _ = assign_splits(entries, data_dir, seed)
    labels = multi_hot(entries["Finding Labels"])
    patients = entries["Patient ID"].to_numpy()
    splits = {}
    for name in SPLIT_NAMES:
        rows = np.flatnonzero(parts == name)
        if len(rows) == 0:
            raise InputError(
                f"The {name} split of {data_dir} is empty ({len(entries)} images in all): "
                f"raise MAX_IMAGES or use the full data set."
            )
        split_paths = [paths[i] for i in rows]
        splits[name] = Split(
            split_paths, labels[rows], patients[rows], copy, copy and copy.rows(split_paths), prepared_size
        )
    return splits


def _prepared(data_dir, entries: pd.DataFrame, size: int, make: bool) -> Prepared:
    """The prepared copy of every image in the CSV at ``size``: made (or remade) if ``make``, else it must exist."""
    paths = locate_images(data_dir, entries["Image Index"].tolist())
    if make:
        return prepare.ensure(data_dir, paths, size)
    found = prepare.find(data_dir, paths, size)
    if found is None:
        raise InputError(
            f"{data_dir} has no valid prepared copy at {size} px: the notebooks make it in their Data section, or run "
            f"`make prepare DATA_DIR={data_dir} IMAGE_SIZE=...` first."
        )
    return found


def describe(splits: dict[str, Split], global_batch: int | None = None, devices: int = 1) -> pd.DataFrame:
    """Images, patients and each finding's prevalence (% of images) in each split: one column per split, for display.

    With ``global_batch`` (on ``devices``), also the training steps per epoch, the last partial batch dropped: a run
    whose training split holds less than one global batch is refused here (:func:`common.run.params.check_steps`).
    One row per quantity keeps the table narrow. Counts and percentages share a column, so the columns hold Python
    objects: counts stay whole numbers, and the percentages, already rounded to 0.1, pass a ``.round(3)`` unchanged.
    """
    counts = pd.DataFrame(
        {name: {"images": len(s), "patients": len(np.unique(s.patients))} for name, s in splits.items()}
    )
    if global_batch is not None:
        steps = params.check_steps(len(splits["train"]), global_batch, devices)
        counts.loc[f"steps of {global_batch} images"] = {"train": steps, "valid": "", "test": ""}
    # float64 first: a float32 rounded to 0.1 would show as 1.2000000476837158 once it is a Python object
    percent = pd.DataFrame({name: s.prevalence() for name, s in splits.items()}, dtype=float).mul(100).round(1)
    return pd.concat([counts.astype(object), percent.add_suffix(" %", axis=0).astype(object)])
