"""What crosses a process boundary, in one schema for every framework.

- A notebook that launches training processes (``torchrun``, ``mpiexec``) writes one :class:`Config` into a work
  folder; every launched script reads it with :func:`read_config`.
- The script's rank 0 hands back one result per mode (``train``, ``benchmark``) with :func:`write_result`: the
  history of the epochs, the test predictions, the phases it timed, the in-RAM images/s, and every rank's
  :func:`rank_report`. The notebook reads it with :func:`read_result`.
- A rank's report of its final weights (a :func:`fingerprint`, its train loss and test AUC) proves that the copies
  stayed in step. Notebooks whose workers are notebooks themselves (TensorFlow workers, MXNet workers) :func:`glue`
  their report into the executed notebook, as scrapbook does, and tests read it back with :func:`read_glued`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tempfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from common.errors import InputError
from common.measure import results
from common.run import devices, params

CONFIG = "config.json"
GLUE_MIME = "application/vnd.multigpu-notebooks+json"


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything a launched training script needs, resolved by the notebook (defaults filled, rules applied)."""

    data_dir: str
    work_dir: str
    device_kind: str  # "gpu" or "cpu" (simulated devices)
    devices: int  # devices of this launch, one process each unless the script drives several itself
    epochs: int
    batch_size_per_device: int
    global_batch: int
    image_size: int
    max_images: int | None
    bench_steps: int
    learning_rate: float  # the peak of the schedule (params.schedule_factor), already scaled to the global batch
    precision: str
    seed: int
    loader_workers: int  # decode processes per training process
    prepared_size: int | None = None  # the side images are shrunk to (common.data.prepare); None: as decoded
    prepared: bool = True  # read from the copy prepared at that size, which the notebook checked; False: the PNGs
    pretrained: bool = False
    batch_norm_batches: int = params.BATCH_NORM_BATCHES
    checkpoint_dir: str | None = None
    checkpoint_settings: dict = dataclasses.field(default_factory=dict)
    resume_from: str | None = None  # a checkpoint's state file
    extra: dict = dataclasses.field(default_factory=dict)  # what one notebook's script alone needs


def write_config(config: Config, name: str = CONFIG) -> Path:
    """``<work_dir>/config.json`` (or ``name``); returns its path, the launched script's argument."""
    path = Path(config.work_dir) / name
    results.atomic_write(path, lambda file: json.dump(dataclasses.asdict(config), file, indent=1))
    return path


def multinode_config(config_file, nodes: int) -> Path:
    """The config of the same run on ``nodes`` machines like this one, read by every process of all of them.

    The scaling rule holds for the whole run: the global batch grows with the processes of every machine, and the
    learning rate with it (by the square root, :func:`common.run.params.learning_rate`). Returns the path of
    ``config-<nodes>-nodes.json`` beside ``config_file``.
    """
    params.check_positive_int("nodes", nodes)
    config = read_config(config_file)
    whole = dataclasses.replace(
        config,
        global_batch=config.global_batch * nodes,
        learning_rate=params.scale_learning_rate(config.learning_rate, nodes),
    )
    return write_config(whole, f"config-{nodes}-nodes.json")


def check_world(config: Config, world_size: int) -> None:
    """Stop a launched process whose world is not the one its config was written for: each process keeps its batch,
    so ``world_size`` processes make a global batch of ``world_size`` batches, and the learning rate was scaled to the
    config's global batch. On several machines, the config of the whole run comes from :func:`multinode_config`."""
    joined = config.batch_size_per_device * world_size
    if joined != config.global_batch:
        raise InputError(
            f"{world_size} processes joined, making a global batch of {joined} ({config.batch_size_per_device} each), "
            f"but this config was written for a global batch of {config.global_batch} and its learning rate: on "
            "several machines, give every process the config of the whole run, protocol.multinode_config(config, "
            "nodes) (the notebook's 'More than one machine' cell prints the commands with it)."
        )


def launch_config(
    work_dir,
    data_dir,
    cfg: dict,
    hardware,
    *,
    global_batch: int,
    learning_rate: float,
    precision: str,
    seed: int,
    pretrained: bool = False,
    processes: int | None = None,
    checkpoint_dir=None,
    checkpoint_settings: dict | None = None,
    resume_from=None,
    **extra,
) -> Path:
    """Write the :class:`Config` of a launch on ``hardware`` (a :class:`common.run.devices.Devices`) with the filled
    parameters ``cfg`` (:func:`common.run.params.fill`); ``processes`` train (one per device unless given);
    ``resume_from`` is a :class:`common.run.checkpoints.Checkpoint` or None. Returns the path of ``config.json``."""
    return write_config(
        Config(
            data_dir=str(data_dir),
            work_dir=str(work_dir),
            device_kind=hardware.kind,
            devices=hardware.count,
            epochs=cfg["EPOCHS"],
            batch_size_per_device=cfg["BATCH_SIZE_PER_DEVICE"],
            global_batch=global_batch,
            image_size=cfg["IMAGE_SIZE"],
            max_images=cfg["MAX_IMAGES"],
            bench_steps=cfg["BENCH_STEPS"],
            learning_rate=learning_rate,
            precision=precision,
            seed=seed,
            loader_workers=devices.loader_workers(hardware.kind, hardware.count, processes),
            prepared_size=cfg.get("PREPARED_SIZE"),
            prepared=cfg.get("PREPARED", True),
            pretrained=pretrained,
            batch_norm_batches=params.BATCH_NORM_BATCHES,
            checkpoint_dir=None if checkpoint_dir is None else str(checkpoint_dir),
            checkpoint_settings=checkpoint_settings or {},
            resume_from=None if resume_from is None else str(resume_from.state),
            extra=extra,
        )
    )


def read_config(path) -> Config:
    return Config(**json.loads(Path(path).read_text()))


def work_dir(prefix: str) -> Path:
    """A fresh folder for a launched run's script, config and results."""
    return Path(tempfile.mkdtemp(prefix=f"{prefix}-"))


def new_history(train_images: int, images_per_epoch: int) -> dict:
    """What every training loop records per epoch (and checkpoints carry): the same keys in every framework.

    ``data_wait_seconds``: the time the loop spent waiting for the next batch (measured; None where the framework
    does not let the loop see it, as in Keras' ``model.fit``).
    """
    return {
        "epoch_seconds": [],
        "train_loss": [],
        "valid_auc": [],
        "data_wait_seconds": [],
        "train_images": train_images,
        "images_per_epoch": images_per_epoch,
    }


def fingerprint(named_arrays: Iterable[tuple[str, np.ndarray]]) -> str:
    """sha256 over ``(name, array)`` pairs in the given order: equal weights give equal fingerprints.

    Every framework's ``weights_fingerprint(model)`` feeds its parameters and BatchNorm statistics through this.
    """
    digest = hashlib.sha256()
    for name, array in named_arrays:
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def rank_report(rank: int, weights_sha256: str, train_loss: float, test_auc: float) -> dict:
    """One rank's (or worker's) account of its final weights; printed, so a multi-machine log shows it too."""
    print(
        f"rank {rank}: weights sha256 {weights_sha256}, train loss {train_loss:.6f}, test AUC {test_auc:.6f}",
        flush=True,
    )
    return {"rank": rank, "weights_sha256": weights_sha256, "train_loss": train_loss, "test_auc": test_auc}


def check_in_step(reports: list[dict]) -> str:
    """The one fingerprint all ranks share; raises naming each rank's when they differ (the copies drifted apart)."""
    found = {report["weights_sha256"] for report in reports}
    if len(found) != 1:
        ranks = ", ".join(f"rank {r['rank']}: {r['weights_sha256'][:12]}" for r in reports)
        raise RuntimeError(f"the ranks ended with different weights ({ranks}): data parallelism lost sync")
    return found.pop()


def write_result(work_dir, mode: str, predictions: tuple[np.ndarray, np.ndarray] | None = None, **fields) -> Path:
    """Rank 0's result of ``mode`` (``train``, ``benchmark``, or a variant's name): JSON fields, test predictions.

    The predictions are written first and the JSON last, each whole or not at all, so a result that exists is
    complete. Usual fields: ``history`` (:func:`new_history`), ``phases`` (:meth:`common.measure.phases.Phases.rows`),
    ``ranks`` (:func:`rank_report` of every rank), ``images_per_second`` (global, all devices together).
    """
    folder = Path(work_dir)
    if predictions is not None:
        labels, scores = predictions
        results.atomic_write(folder / f"{mode}.npz", lambda file: np.savez(file, labels=labels, scores=scores), "wb")
    path = folder / f"{mode}.json"
    results.atomic_write(path, lambda file: json.dump(fields, file, default=results.jsonable))
    return path


def read_result(work_dir, mode: str) -> dict:
    """What :func:`write_result` wrote, with ``labels`` and ``scores`` arrays when there were predictions."""
    folder = Path(work_dir)
    found = json.loads((folder / f"{mode}.json").read_text())
    if (folder / f"{mode}.npz").is_file():
        with np.load(folder / f"{mode}.npz") as predictions:
            found.update(labels=predictions["labels"], scores=predictions["scores"])
    return found


def glue(name: str, value) -> None:
    """Store a JSON value in the executed notebook under ``name`` (papermill keeps it); :func:`read_glued` reads it."""
    from IPython.display import display

    display({GLUE_MIME: {"name": name, "value": value}}, raw=True, metadata={GLUE_MIME: {"name": name}})


def read_glued(notebook) -> dict:
    """``{name: value}`` of everything an executed notebook glued (the last value of a name wins)."""
    import nbformat

    found = {}
    for cell in nbformat.read(notebook, as_version=4).cells:
        for output in cell.get("outputs", []):
            data = output.get("data", {}).get(GLUE_MIME)
            if data is not None:
                found[data["name"]] = data["value"]
    return found
