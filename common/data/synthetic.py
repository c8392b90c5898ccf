"""A generated stand-in for ChestX-ray14, in exactly its file layout.

Every image is a gray chest-like picture; each finding it carries is drawn as
its own small glyph (a ring, a cross, a bar, ...) somewhere in the lung field,
so a convolutional network can learn all 14 findings in a few epochs on a CPU.
Labels follow the real data set's prevalence, with "No Finding" the most
common, and several images per patient share most of their findings, so a
split that leaks patients would be visible. Deterministic from the seed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
from PIL import Image, ImageDraw

from common.data.layout import CSV_NAME, NO_FINDING, TEST_LIST, TRAIN_VAL_LIST, cache_root
from common.run.params import FINDINGS

# Share of images with each finding in the NIH release, raised to at least 3%
# so that the test split of a small stand-in still holds positives of each.
PREVALENCE = dict(
    zip(
        FINDINGS,
        (0.103, 0.030, 0.119, 0.177, 0.052, 0.056, 0.030, 0.047, 0.042, 0.030, 0.030, 0.030, 0.030, 0.030),
    )
)
# A finding of a patient shows on each of their images with this probability.
KEEP_PER_IMAGE = 0.8
COLUMNS = (
    "Image Index",
    "Finding Labels",
    "Follow-up #",
    "Patient ID",
    "Patient Age",
    "Patient Gender",
    "View Position",
    "OriginalImage[Width",
    "Height]",
    "OriginalImagePixelSpacing[x",
    "y]",
    "",  # the NIH file ends every line with a comma
)
COMPLETE_MARKER = ".complete"
# What ``DATA_DIR=None`` generates: a quick demo on a CPU, enough images for
# realistic input-pipeline load on GPUs.
STANDIN = {"cpu": dict(n_images=1000, image_size=128), "gpu": dict(n_images=20000, image_size=256)}


def _glyph(draw: ImageDraw.ImageDraw, finding: int, cx: float, cy: float, r: float, shade: int, width: int) -> None:
    """Draw finding number ``finding`` as its own shape centred at (cx, cy) with radius r."""
    box = (cx - r, cy - r, cx + r, cy + r)
    small = (cx - r / 2, cy - r / 2, cx + r / 2, cy + r / 2)
    shapes = {
        0: lambda: draw.rectangle((cx - r, cy - r / 5, cx + r, cy + r / 5), fill=shade),  # horizontal bar
        1: lambda: draw.ellipse(box, outline=shade, width=width * 2),  # thick ring
        2: lambda: draw.rectangle((cx - r, cy, cx + r, cy + r), fill=shade),  # lower half block
        3: lambda: [
            draw.ellipse((x - width, y - width, x + width, y + width), fill=shade)  # dot grid
            for x in (cx - r, cx, cx + r)
            for y in (cy - r, cy, cy + r)
        ],
        4: lambda: draw.ellipse(box, fill=shade),  # large disc
        5: lambda: draw.ellipse(small, fill=shade),  # small disc
        6: lambda: draw.rectangle(small, outline=shade, width=width),  # small square outline
        7: lambda: draw.ellipse(box, outline=shade, width=width),  # thin ring
        8: lambda: draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=shade),  # triangle
        9: lambda: [draw.line((x, cy - r, x, cy + r), fill=shade, width=width) for x in (cx - r, cx, cx + r)],  # bars
        10: lambda: (
            draw.line((cx - r, cy, cx + r, cy), fill=shade, width=width),  # plus
            draw.line((cx, cy - r, cx, cy + r), fill=shade, width=width),
        ),
        11: lambda: (
            draw.line((cx - r, cy - r, cx + r, cy + r), fill=shade, width=width),  # x
            draw.line((cx - r, cy + r, cx + r, cy - r), fill=shade, width=width),
        ),
        12: lambda: draw.rectangle((cx - r / 5, cy - r, cx + r / 5, cy + r), fill=shade),  # vertical bar
        13: lambda: draw.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], outline=shade, width=width),
    }
    shapes[finding]()


def render(findings, size: int, rng: np.random.Generator) -> Image.Image:
    """One grayscale chest-like image of ``size`` pixels showing the given finding indices."""
    image = Image.new("L", (size, size), color=int(rng.integers(20, 40)))
    draw = ImageDraw.Draw(image)
    body = int(rng.integers(95, 125))
    draw.ellipse((size * 0.08, size * 0.05, size * 0.92, size * 1.1), fill=body)  # thorax
    lung = body - int(rng.integers(45, 60))
    lungs = [(size * 0.16, size * 0.14, size * 0.47, size * 0.86), (size * 0.53, size * 0.14, size * 0.84, size * 0.86)]
    for box in lungs:
        draw.ellipse(box, fill=lung)
    width = max(1, round(size / 48))
    for finding in findings:
        x0, y0, x1, y1 = lungs[int(rng.integers(2))]
        r = size * rng.uniform(0.07, 0.09)
        cx, cy = rng.uniform(x0 + r, x1 - r), rng.uniform(y0 + r * 1.5, y1 - r * 1.5)
        _glyph(draw, finding, cx, cy, r, shade=int(min(255, lung + rng.integers(90, 130))), width=width)
    pixels = np.asarray(image, dtype=np.float32) + rng.normal(0.0, 8.0, (size, size))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), mode="L")


def _patients(n_images: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """(patient id, follow-up number) for each image: 1 to 6 images per patient."""
    rows, patient = [], 0
    while len(rows) < n_images:
        patient += 1
        rows += [(patient, follow_up) for follow_up in range(int(rng.integers(1, 7)))]
    return rows[:n_images]


def labels_for(n_images: int, seed: int) -> pd.DataFrame:
    """The CSV rows (without pixels): patients, follow-ups and findings, drawn from the seed."""
    rng = np.random.default_rng([seed, 0])
    rows = _patients(n_images, rng)
    prevalence = np.array([PREVALENCE[name] for name in FINDINGS])
    chronic, records = {}, []
    for patient, follow_up in rows:
        if patient not in chronic:
            chronic[patient] = (
                rng.random(len(FINDINGS)) < prevalence / KEEP_PER_IMAGE,
                int(rng.integers(20, 85)),
                str(rng.choice(["M", "F"])),
            )
        has, age, gender = chronic[patient]
        present = has & (rng.random(len(FINDINGS)) < KEEP_PER_IMAGE)
        names = [name for name, on in zip(FINDINGS, present) if on]
        records.append(
            {
                "Image Index": f"{patient:08d}_{follow_up:03d}.png",
                "Finding Labels": "|".join(names) or NO_FINDING,
                "Follow-up #": follow_up,
                "Patient ID": patient,
                "Patient Age": age + follow_up // 3,
                "Patient Gender": gender,
                "View Position": str(rng.choice(["PA", "AP"], p=[0.6, 0.4])),
            }
        )
    return pd.DataFrame.from_records(records)


def generate(out_dir, n_images: int = 1000, image_size: int = 128, seed: int = 0, test_fraction: float = 0.2) -> Path:
    """Write the stand-in data set to ``out_dir`` (which must not exist yet) and return it.

    Written into a temporary folder beside ``out_dir`` and renamed when complete,
    so an interrupted run never leaves a half-written data set behind.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        entries = labels_for(n_images, seed)
        (work / "images").mkdir()
        index = {name: i for i, name in enumerate(FINDINGS)}
        for row, (name, labels) in enumerate(zip(entries["Image Index"], entries["Finding Labels"])):
            findings = [index[label] for label in labels.split("|") if label in index]
            render(findings, image_size, np.random.default_rng([seed, 1, row])).save(work / "images" / name)
        entries["OriginalImage[Width"] = image_size
        entries["Height]"] = image_size
        entries["OriginalImagePixelSpacing[x"] = round(0.143 * 1024 / image_size, 4)
        entries["y]"] = round(0.143 * 1024 / image_size, 4)
        entries[""] = ""
        entries[list(COLUMNS)].to_csv(work / CSV_NAME, index=False)
        _write_official_lists(work, entries, seed, test_fraction)
        (work / COMPLETE_MARKER).write_text(f"n_images={n_images} image_size={image_size} seed={seed}\n")
        os.replace(work, out_dir)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return out_dir


def _write_official_lists(folder: Path, entries: pd.DataFrame, seed: int, test_fraction: float) -> None:
    """Patient-disjoint train_val/test lists, as NIH ships them."""
    patients = entries["Patient ID"].unique()
    rng = np.random.default_rng([seed, 2])
    test_patients = set(rng.permutation(patients)[: max(1, round(len(patients) * test_fraction))].tolist())
    is_test = entries["Patient ID"].isin(test_patients)
    (folder / TEST_LIST).write_text("\n".join(entries.loc[is_test, "Image Index"]) + "\n")
    (folder / TRAIN_VAL_LIST).write_text("\n".join(entries.loc[~is_test, "Image Index"]) + "\n")


def is_generated(folder) -> bool:
    """Whether ``folder`` holds a data set written by :func:`generate` (not real X-rays)."""
    return (Path(folder) / COMPLETE_MARKER).is_file()


def ensure(n_images: int = 1000, image_size: int = 128, seed: int = 0, root=None) -> Path:
    """The cached stand-in data set for these settings, generated on first use."""
    folder = Path(root or cache_root()) / f"chestxray-synthetic-n{n_images}-px{image_size}-seed{seed}"
    if is_generated(folder):
        return folder
    if folder.exists():  # left by an older layout: regenerate rather than trust it
        shutil.rmtree(folder)
    print(f"Generating the ChestX-ray14 stand-in ({n_images} images of {image_size} px) in {folder} ...")
    try:
        return generate(folder, n_images=n_images, image_size=image_size, seed=seed)
    except OSError:
        if is_generated(folder):  # another process finished it first
            return folder
        raise


def data_dir(given, device_kind: str, seed: int = 0) -> Path:
    """The ``DATA_DIR`` parameter resolved: the folder given, or the stand-in generated for this kind of machine."""
    return Path(given) if given else ensure(**STANDIN[device_kind], seed=seed)


def data_kind(folder) -> str:
    """What a results record calls the data of ``folder``: ``generated`` (this stand-in) or ``real``."""
    return "generated" if is_generated(folder) else "real"
