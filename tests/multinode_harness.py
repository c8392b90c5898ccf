"""Two "nodes" on one machine: the training script a notebook writes, its config, and what each rank reports.

A notebook's training script is the source of its ``%%writefile`` cell, so the multi-node tests run exactly
what a user copies to the hosts, without running the whole notebook first. What the ranks report comes back
through :mod:`common.run.protocol`: the launched scripts' result (rank 0 gathers every rank's report), or the value
each notebook worker glued into its executed notebook.
"""

import json
import sys
from pathlib import Path

import nbformat
from notebook_harness import NOTEBOOK_DIR, notebook_path

from common.data import chestxray
from common.run import devices, params, protocol


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
    CPUs, after the data check that prepares the data as a notebook does; ``extra`` are the script's own entries."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = params.fill("cpu", **settings)
    chestxray.load(data_dir, cfg["MAX_IMAGES"], 0, prepared_size=cfg["PREPARED_SIZE"])
    global_batch = params.global_batch(cfg["BATCH_SIZE_PER_DEVICE"], devices_total)
    hardware = devices.resolve(devices_total, gpus=[])
    return protocol.launch_config(
        folder,
        data_dir,
        cfg,
        hardware,
        global_batch=global_batch,
        learning_rate=params.learning_rate(cfg, global_batch),
        precision="fp32",
        seed=0,
        **extra,
    )


def assert_ranks_agree(reports: list[dict], world_size: int, *, same_loss: bool = True) -> None:
    """Every rank reported, with the same weights and test AUC (and train loss, unless each had its own share)."""
    assert sorted(report["rank"] for report in reports) == list(range(world_size)), f"reports: {reports}"
    fields = ("weights_sha256", "test_auc", "train_loss") if same_loss else ("weights_sha256", "test_auc")
    distinct = {tuple(report[field] for field in fields) for report in reports}
    assert len(distinct) == 1, f"the ranks disagree: {reports}"


def papermill_command(notebook: str, output: Path, **parameters) -> list[str]:
    """papermill on the command line, as a user starts a notebook on each host (in the kernel the notebook names); cell
    outputs go to its log."""
    command = [sys.executable, "-m", "papermill", str(notebook_path(notebook)), str(output)]
    command += ["--cwd", str(NOTEBOOK_DIR), "--log-output", "--no-progress-bar", "-y", json.dumps(parameters)]
    return command
