"""Two "nodes" on one machine: the training script a notebook writes, its config, and what each rank reports.

A notebook's training script is the source of its ``%%writefile`` cell, so the multi-node tests run exactly
what a user copies to the hosts, without running the whole notebook first.
"""

import json
import re
import sys
from pathlib import Path

import nbformat
from notebook_harness import KERNEL, NOTEBOOK_DIR, notebook_path

from common import devices, params

# Each training script prints one such line per rank (or TensorFlow worker) once training and the test are done.
RANK_LINE = re.compile(r"(?:rank|worker) (\d+): weights sha256 ([0-9a-f]{64}), train loss (\S+), test AUC (\S+)")


def write_script(notebook: str, name: str, folder: Path) -> Path:
    """The training script ``name`` as notebook ``notebook`` writes it, saved into ``folder``."""
    marker = f"%%writefile {{work_dir}}/{name}\n"
    cells = nbformat.read(notebook_path(notebook), as_version=4).cells
    source = next(cell.source for cell in cells if cell.cell_type == "code" and cell.source.startswith(marker))
    script = folder / name
    script.write_text(source.removeprefix(marker))
    return script


def write_config(folder: Path, data_dir, devices_total: int, settings: dict, **extra) -> Path:
    """The ``config.json`` a notebook writes for notebook parameters ``settings`` and ``devices_total`` ranks on
    CPUs; ``extra`` adds or overrides entries."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = params.fill("cpu", **settings)
    config = {
        **cfg,
        "DATA_DIR": str(data_dir),
        "WORK_DIR": str(folder),
        "LEARNING_RATE": params.learning_rate(cfg["LEARNING_RATE_PER_DEVICE"], devices_total),
        "PRECISION": "fp32",
        "PRETRAINED": False,
        "SEED": 0,
        "LOADER_WORKERS": devices.loader_workers(devices_total, "cpu"),
        "BATCH_NORM_BATCHES": 2,
        "CHECKPOINT_DIR": None,
        "CHECKPOINT_SETTINGS": {},
        "RESUME_FROM": None,
        **extra,
    }
    path = folder / "config.json"
    path.write_text(json.dumps(config, indent=1))
    return path


def rank_reports(*outputs: str) -> dict[int, tuple[str, float, float]]:
    """``{rank: (weights sha256, train loss, test AUC)}`` from the logs of every node."""
    found = {}
    for output in outputs:
        for rank, digest, loss, auc in RANK_LINE.findall(output):
            assert int(rank) not in found, f"rank {rank} reported twice"
            found[int(rank)] = (digest, float(loss), float(auc))
    return found


def assert_ranks_agree(reports: dict, world_size: int) -> None:
    """Every rank reported, with the same weights and the same metrics."""
    assert sorted(reports) == list(range(world_size)), f"ranks that reported: {sorted(reports)}"
    distinct = set(reports.values())
    assert len(distinct) == 1, f"the ranks disagree: {reports}"


def papermill_command(notebook: str, output: Path, **parameters) -> list[str]:
    """papermill on the command line, as a user starts a notebook on each host; cell outputs go to its log."""
    command = [sys.executable, "-m", "papermill", str(notebook_path(notebook)), str(output), "-k", KERNEL]
    command += ["--cwd", str(NOTEBOOK_DIR), "--log-output", "--no-progress-bar", "-y", json.dumps(parameters)]
    return command
