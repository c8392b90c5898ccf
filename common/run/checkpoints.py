"""Per-epoch checkpoints that survive a killed run, and the decision to resume, the same in every framework.

Each finished epoch N leaves two files in ``CHECKPOINT_DIR``: the framework's state
(``epoch-000N.<ext>``: model, optimizer, schedule, RNG), then ``epoch-000N.json`` with the epoch,
the run's settings and its history so far. Each is written under a temporary name and renamed, the
JSON last, so a checkpoint exists only once both are complete: a run killed while writing one leaves
the previous checkpoint as the newest.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from common.errors import InputError
from common.measure import results

KEEP = 2  # the newest two: one spare in case the disk itself loses the newest
_META = re.compile(r"epoch-(\d{4,})\.json")


@dataclass(frozen=True)
class Checkpoint:
    epoch: int  # epochs finished
    state: Path  # the framework's file
    settings: dict
    history: dict


def _stem(epoch: int) -> str:
    return f"epoch-{epoch:04d}"


def complete(folder) -> list[Checkpoint]:
    """The complete checkpoints in ``folder``, oldest first."""
    found = []
    for meta in Path(folder).glob("epoch-*.json"):
        if not _META.fullmatch(meta.name):
            continue
        saved = json.loads(meta.read_text())
        state = meta.with_name(saved["state"])
        if state.exists():
            found.append(Checkpoint(saved["epoch"], state, saved["settings"], saved["history"]))
    return sorted(found, key=lambda checkpoint: checkpoint.epoch)


def of_state(state) -> Checkpoint:
    """The checkpoint that ``state`` belongs to, as a notebook hands it to its training processes."""
    epoch = int(re.match(r"epoch-(\d+)", Path(state).name).group(1))
    saved = json.loads((Path(state).parent / f"{_stem(epoch)}.json").read_text())
    return Checkpoint(saved["epoch"], Path(state), saved["settings"], saved["history"])


def start(checkpoint_dir, resume: bool, settings: dict) -> Checkpoint | None:
    """Check ``CHECKPOINT_DIR`` and ``RESUME`` before any training: the checkpoint to continue from, or None.

    ``settings`` are the run's parameters that shape training; a checkpoint
    written with other values is refused rather than continued into a different run.
    """
    if checkpoint_dir is None:
        if resume:
            raise InputError(
                "RESUME=True needs CHECKPOINT_DIR: set it to the folder the interrupted run wrote its checkpoints to."
            )
        return None
    folder = results.check_writable(checkpoint_dir, "CHECKPOINT_DIR")
    found = complete(folder)
    if not found:
        if resume:
            print(f"RESUME: no complete checkpoint in {folder} yet, so training starts at epoch 1.")
        return None
    newest = found[-1]
    if not resume:
        raise InputError(
            f"CHECKPOINT_DIR {folder} already holds the checkpoint of epoch {newest.epoch} of an earlier run: "
            f"set RESUME=True to continue that run, or choose an empty folder."
        )
    settings = json.loads(json.dumps(settings))  # compare as saved: tuples become lists
    differ = {
        name: (newest.settings.get(name), value)
        for name, value in settings.items()
        if newest.settings.get(name) != value
    }
    if differ:
        changes = ", ".join(f"{name} was {old!r}, now {new!r}" for name, (old, new) in differ.items())
        raise InputError(
            f"The checkpoint of epoch {newest.epoch} in {folder} comes from a run with other settings ({changes}): "
            f"resume with the settings it was written with, or choose an empty CHECKPOINT_DIR for a new run."
        )
    for stale in folder.glob(".epoch-*"):  # temporaries of a write that a kill interrupted
        _remove(stale)
    print(f"Resuming after epoch {newest.epoch} from {newest.state}")
    return newest


def save(folder, epoch: int, suffix: str, write_state, settings: dict, history: dict) -> Path:
    """Write the checkpoint of ``epoch``; ``write_state(path)`` saves the framework's state to ``path``.

    ``path`` is a temporary name that ends in ``suffix``, as some frameworks' savers require; it may be
    a file or, for savers that write several files, a folder (renamed as a whole).
    """
    folder = Path(folder)
    state = folder / f"{_stem(epoch)}{suffix}"
    temporary = folder / f".{_stem(epoch)}-{uuid.uuid4().hex[:8]}{suffix}"
    try:
        write_state(temporary)
        for path in sorted(temporary.rglob("*")) if temporary.is_dir() else [temporary]:
            if path.is_file():
                with open(path, "rb") as file:
                    os.fsync(file.fileno())  # on disk before the rename: not even a power cut leaves half a state
        if state.exists():  # left by a run killed between this rename and the JSON
            _remove(state)
        os.replace(temporary, state)
    finally:
        if temporary.exists():
            _remove(temporary)
    meta = {"epoch": epoch, "state": state.name, "settings": settings, "history": history}
    results.atomic_write(folder / f"{_stem(epoch)}.json", lambda file: json.dump(meta, file, indent=1))
    for old in complete(folder)[:-KEEP]:
        old.state.with_name(f"{_stem(old.epoch)}.json").unlink()  # the JSON first: never a checkpoint without state
        _remove(old.state)
    return state


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
