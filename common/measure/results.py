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
from typing import NamedTuple

import pandas as pd

from common.errors import InputError

IN_RAM = "synthetic-in-RAM"  # the benchmark on one random batch held in device memory
DATA_KINDS = ("real", "generated", IN_RAM)
# The fields every record carries, and what each means, the same in every framework.
FIELDS = {
    "framework": "pytorch, tensorflow, keras, mxnet or chainer",
    "notebook": "the notebook's name; with `variant`, the way of placing the model it measured",
    "devices": "the devices that computed the run, over all processes and machines: DDP or MPI ranks, "
    "TensorFlow replicas, Gluon contexts times workers",
    "device_kind": "gpu, or cpu for simulated devices sharing one machine's cores",
    "device_names": "this machine's devices that the run used",
    "precision": "fp32 or mixed, as it ran",
    "global_batch": "images per optimizer step, all devices together",
    "image_size": "side of the square network input in pixels",
    "epochs": "epochs trained (0 for the in-RAM benchmark)",
    "data": "real, generated (the stand-in data set), or synthetic-in-RAM (one random batch held in memory)",
    "train_images": "images in the training split",
    "epoch_seconds": "training seconds of each epoch, validation left out",
    "images_per_second": "training throughput of all devices together, the first epoch left out when there are more",
    "test_auc": "mean ROC AUC over the findings defined in the test split",
    "per_class_auc": "ROC AUC of each finding (null where the test split holds one label value only)",
    "device_utilization": "mean utilization and peak memory of each device while it trained or benchmarked",
    "versions": "Python's and the framework's package versions",
    "git_commit": "the commit of this repository",
    "timestamp": "when the record was made, UTC",
}
REQUIRED = tuple(FIELDS)


def label(record: dict) -> str:
    """The notebook, and the placement it measured where one notebook compares several (``variant``)."""
    return f"{record['notebook']} ({record['variant']})" if record.get("variant") else record["notebook"]


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


class Run:
    """What the records of one notebook run share; :meth:`training` and :meth:`benchmark` make its two records.

    ``cfg`` are the filled parameters (:func:`common.run.params.fill`): the image size, the batch per device, the
    prepared size (None: PNGs decoded each epoch) and the precision, unless ``precision`` says what ran instead;
    ``devices`` follows ``FIELDS["devices"]``; ``learning_rate`` is the scaled peak rate; ``packages`` are the
    distributions whose versions are recorded; ``extra`` are the framework's own fields (a strategy, a kvstore, ...), in
    both records."""

    def __init__(
        self,
        framework: str,
        notebook: str,
        hardware,
        cfg: dict,
        *,
        devices: int,
        global_batch: int,
        learning_rate: float,
        precision: str | None = None,
        packages: tuple[str, ...] = (),
        **extra,
    ):
        self.epochs = cfg["EPOCHS"]
        self.fields = {
            **dict(
                framework=framework,
                notebook=notebook,
                devices=devices,
                device_kind=hardware.kind,
                device_names=list(hardware.names),
                precision=precision or cfg["PRECISION"],
                global_batch=global_batch,
                batch_size_per_device=cfg["BATCH_SIZE_PER_DEVICE"],
                image_size=cfg["IMAGE_SIZE"],
                prepared_size=cfg["PREPARED_SIZE"] if cfg.get("PREPARED", True) else None,
                learning_rate=learning_rate,
                versions=versions(*packages),
            ),
            **extra,
        }

    def training(self, data: str, history: dict, auc, samples, phases=None, **extra) -> Record:
        """The training run's record: ``history`` as :func:`common.run.protocol.new_history` keeps it, ``auc`` the test
        set's :class:`common.measure.metrics.AUC`, ``samples`` the :class:`common.measure.monitor.Monitor` that watched
        the devices, ``phases`` a :class:`common.measure.phases.Phases`; ``extra`` adds fields or overrides the
        run's."""
        from common.measure.metrics import images_per_second

        return self._record(
            samples,
            data=data,
            epochs=self.epochs,
            train_images=history["train_images"],
            epoch_seconds=history["epoch_seconds"],
            images_per_second=images_per_second(history["images_per_epoch"], history["epoch_seconds"]),
            train_loss=history.get("train_loss"),
            valid_auc=history.get("valid_auc") or None,
            data_wait_seconds=history.get("data_wait_seconds"),
            test_auc=auc.mean,
            per_class_auc=auc.per_class,
            phases=phases.rows() if phases is not None else None,
            **extra,
        )

    def benchmark(self, images_per_second: float, samples, **extra) -> Record:
        """The in-RAM benchmark's record: the same step on one random batch held in device memory."""
        return self._record(
            samples,
            data=IN_RAM,
            epochs=0,
            train_images=0,
            epoch_seconds=[],
            images_per_second=images_per_second,
            test_auc=None,
            per_class_auc={},
            **extra,
        )

    def _record(self, samples, **fields) -> Record:
        fields = {
            **self.fields,
            "device_utilization": samples.summary(),
            "utilization_started": samples.started,
            **fields,
        }
        return Record(new_record(**fields), samples.frame())


class Record(NamedTuple):
    fields: dict
    utilization: pd.DataFrame | None = None


def write_all(records: list[Record], results_dir, chief: bool = True, who: str = "") -> list[Path]:
    """Write the records of a run, from the chief alone: with several workers, one run gets one set of records."""
    if not chief:
        print(f"{who}: the chief writes the records")
        return []
    paths = [write(record.fields, results_dir, record.utilization) for record in records]
    for path in paths:
        print(path)
    return paths


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


def atomic_write(path: Path, write, mode: str = "w") -> None:
    """Call ``write(file)`` on a temporary file beside ``path``, then rename it: ``path`` is complete or absent.

    The data reaches the disk before the rename, so not even a power cut leaves a half-written ``path``.
    ``mode="wb"`` for binary writers.
    """
    path = Path(path)
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    try:
        with os.fdopen(handle, mode) as file:
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
    text = json.dumps(record, indent=2, sort_keys=True, default=jsonable)
    if utilization is not None:
        atomic_write(csv, lambda file: utilization.to_csv(file, index=False))
    path = results_dir / f"{stem}.json"
    atomic_write(path, lambda file: file.write(text))
    return path


def jsonable(value):
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
