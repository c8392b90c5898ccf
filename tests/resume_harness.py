"""Kill a notebook run with SIGKILL in the middle of an epoch, then resume it from its checkpoints.

A preempted cloud machine gives no warning: the kill reaches the papermill process, its kernel, the
launcher and every training process at once, so nothing can flush or clean up.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
from notebook_harness import NOTEBOOK_DIR, notebook_path


def kill_tree(pid: int) -> None:
    """SIGKILL a process and everything it started (children are listed first: they would be orphaned)."""
    try:
        parent = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    family = [*parent.children(recursive=True), parent]
    for process in family:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(family, timeout=30)


def run_until_killed(
    name: str, data_dir, out: Path, checkpoint_dir: Path, *, epoch: int, delay: float, timeout: float, **parameters
) -> float:
    """Run notebook ``name`` and SIGKILL it ``delay`` seconds after the checkpoint of ``epoch`` appears.

    Returns the seconds from the start to the kill. Fails, naming the reason, if the run ends or times out
    first, or if the next epoch's checkpoint appeared before the kill (the kill was not mid-epoch).
    """
    out.mkdir(parents=True, exist_ok=True)
    parameters = {
        "DATA_DIR": str(data_dir),
        "RESULTS_DIR": str(out / "results"),
        "CHECKPOINT_DIR": str(checkpoint_dir),
        **parameters,
    }
    command = [
        sys.executable,
        "-m",
        "papermill",
        str(notebook_path(name)),
        str(out / "killed.ipynb"),
        "--cwd",
        str(NOTEBOOK_DIR),
        "-y",
        json.dumps(parameters),
    ]
    log = (out / "killed.log").open("w")
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    marker, after = (checkpoint_dir / f"epoch-{n:04d}.json" for n in (epoch, epoch + 1))
    try:
        while not marker.exists():
            if process.poll() is not None:
                raise AssertionError(
                    f"{name} ended (code {process.returncode}) before the checkpoint of epoch "
                    f"{epoch}; see {out / 'killed.log'}"
                )
            if time.monotonic() - started > timeout:
                raise AssertionError(f"{name} wrote no checkpoint of epoch {epoch} within {timeout:.0f} s")
            time.sleep(0.1)
        time.sleep(delay)
    finally:
        kill_tree(process.pid)
        log.close()
    assert not after.exists(), f"the checkpoint of epoch {epoch + 1} appeared before the kill: increase the epoch time"
    return time.monotonic() - started
