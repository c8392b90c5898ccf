"""One JSON record per run, written atomically, and loaded back many at a time.

The README table and plots are built from these files only.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
import tempfile
import uuid
from importlib import metadata
from pathlib import Path

import pandas as pd

from common.errors import InputError

IN_RAM = "synthetic-in-RAM"  # the benchmark on one random batch held in device memory
DATA_KINDS = ("real", "generated", IN_RAM)
REQUIRED = (
    "framework",
    "notebook",
    "devices",
    "device_kind",
    "device_names",
    "precision",
    "global_batch",
    "image_size",
    "epochs",
    "data",
    "train_images",
    "epoch_seconds",
    "images_per_second",
    "test_auc",
    "per_class_auc",
    "device_utilization",
    "versions",
    "git_commit",
    "timestamp",
)


def check_writable(results_dir, name: str = "RESULTS_DIR") -> Path:
    """Create the folder (the parameter ``name``) if needed and prove a file can be written there, before training."""
    results_dir = Path(results_dir)
    try:
        results_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=results_dir, prefix=".write-test-"):
            pass
    except OSError as error:
        raise InputError(
            f"{name} {results_dir} is not writable ({error.strerror or error}): "
            f"choose a folder you can write to, or fix its permissions."
        ) from None
    return results_dir


def versions(*packages: str) -> dict[str, str | None]:
    """Installed versions of the given distributions (None when missing), plus Python's."""
    found = {"python": platform.python_version()}
    for name in packages:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def git_commit(path=None) -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=path or Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def new_record(**fields) -> dict:
    """A record with the run-independent fields (git commit, timestamp, id) filled in."""
    record = {
        "run_id": uuid.uuid4().hex[:12],
        "git_commit": git_commit(),
        "timestamp": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    record.update(fields)
    return record


def validate(record: dict) -> dict:
    missing = [name for name in REQUIRED if name not in record]
    if missing:
        raise ValueError(f"results record lacks {', '.join(missing)}")
    if record["data"] not in DATA_KINDS:
        raise ValueError(f"results record data must be one of {DATA_KINDS}, not {record['data']!r}")
    if record["device_kind"] not in ("gpu", "cpu"):
        raise ValueError(f"results record device_kind must be 'gpu' or 'cpu', not {record['device_kind']!r}")
    return record


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: Path, write) -> None:
    """Call ``write(file)`` on a temporary file beside ``path``, then rename it: ``path`` is complete or absent.

    The data reaches the disk before the rename, so not even a power cut leaves a half-written ``path``.
    """
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    try:
        with os.fdopen(handle, "w") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        # mkstemp creates owner-only files: keep an existing file's mode, else what umask allows
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write(record: dict, results_dir, utilization: pd.DataFrame | None = None) -> Path:
    """Write ``<notebook>-<devices>dev-<data>-<run_id>.json`` (and the utilization samples as CSV).

    Each file appears complete or not at all: written to a temporary name, then renamed.
    """
    validate(record)
    results_dir = check_writable(results_dir)
    stem = f"{record['notebook']}-{record['devices']}dev-{record['data']}-{record.get('run_id', uuid.uuid4().hex[:12])}"
    csv = results_dir / f"{stem}.utilization.csv"
    if utilization is not None:
        record = {**record, "utilization_csv": csv.name}
    # serialized first: a value JSON cannot store fails here, before any file is written
    text = json.dumps(record, indent=2, sort_keys=True, default=_jsonable)
    if utilization is not None:
        atomic_write(csv, lambda file: utilization.to_csv(file, index=False))
    path = results_dir / f"{stem}.json"
    atomic_write(path, lambda file: file.write(text))
    return path


def _jsonable(value):
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def load(path) -> dict:
    with open(path) as file:
        return validate(json.load(file))


def load_all(results_dir) -> list[dict]:
    """Every record under ``results_dir``, oldest first; each carries its own path."""
    records = []
    for path in sorted(Path(results_dir).glob("*.json")):
        record = load(path)
        record["path"] = str(path)
        records.append(record)
    return sorted(records, key=lambda r: r["timestamp"])
