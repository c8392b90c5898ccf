"""Run a multi-process launcher from a notebook: stream its log into the cell, fail the cell if it fails."""

from __future__ import annotations

import codecs
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections import deque

import psutil

from common.errors import Interrupted
from common.run import reaper

# The notebook parameters that shape a run: a worker started by hand on another machine gets every one of them, so that
# it trains the run its notebook printed, not its own machine's defaults.
WORKER_PARAMETERS = (
    "EPOCHS", "BATCH_SIZE_PER_DEVICE", "IMAGE_SIZE", "MAX_IMAGES", "PRECISION", "PRETRAINED", "PREPARED", "SEED",
)  # fmt: skip


def papermill_parameters(cfg: dict, **given) -> str:
    """``-p NAME VALUE`` for each of :data:`WORKER_PARAMETERS` as filled in ``cfg`` (or given), then each of ``given``,
    quoted for a shell: the notebook's own run, for the workers of a multi-machine run."""
    values = {name: given.pop(name, cfg.get(name)) for name in WORKER_PARAMETERS}
    return " ".join(f"-p {name} {shlex.quote(str(value))}" for name, value in {**values, **given}.items())


def tf_config(workers: list[str], index: int) -> str:
    """The ``TF_CONFIG`` of worker ``index`` in a cluster of ``workers`` (``host:port`` each, the same list everywhere).

    TensorFlow's ``MultiWorkerMirroredStrategy`` reads it from the environment. Every worker gets the same cluster and
    its own index; worker 0 is the chief, which writes the results.
    """
    return json.dumps({"cluster": {"worker": list(workers)}, "task": {"type": "worker", "index": index}})


class LaunchError(RuntimeError):
    """A launched training command exited with an error (any rank failing fails the launch)."""


def run(command: list[str], env: dict[str, str] | None = None, cwd=None, tail_lines: int = 30) -> tuple[float, float]:
    """Run ``command``, echo its output as it arrives, raise :class:`LaunchError` on a non-zero exit.

    Returns when it started and when it had exited (Unix seconds), for
    :meth:`common.measure.phases.Phases.add_launched`.

    Output is copied in raw chunks rather than lines, so progress bars that
    redraw with carriage returns stay on one line in Jupyter. Interrupting the
    cell stops the whole process group, workers included; a killed kernel
    leaves that to :mod:`common.run.reaper`.
    """
    started = time.time()
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
        cwd=cwd,
        start_new_session=True,
    )
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    tail: deque[str] = deque(maxlen=tail_lines)
    partial = ""
    watcher = None
    try:  # from here on the stop button stops the launch, even while the watcher starts
        # -P keeps common/run/ off the watcher's sys.path: it is a script that needs psutil only
        watcher = subprocess.Popen([sys.executable, "-P", reaper.__file__, str(process.pid)], stdin=subprocess.PIPE,
                                   start_new_session=True)  # fmt: skip
        while chunk := os.read(process.stdout.fileno(), 65536):
            text = decoder.decode(chunk)
            sys.stdout.write(text)
            sys.stdout.flush()
            lines = (partial + text).split("\n")
            partial = lines.pop()
            tail.extend(lines)
        code = process.wait()
    except BaseException as error:
        stopped = _stop(process)
        if isinstance(error, KeyboardInterrupt):  # the stop button: say what it ended, without a traceback
            raise Interrupted(f"stopped {name(command)} and the {stopped} process(es) it started.") from None
        raise
    finally:
        process.stdout.close()
        if watcher is not None:
            watcher.stdin.close()
            watcher.wait()
    if code != 0:
        tail.append(partial)
        raise LaunchError(
            f"{name(command)} {' '.join(command[3:5] if command[1:2] == ['-m'] else command[1:3])} ... exited with "
            f"code {code}; "
            f"its last lines:\n" + "\n".join(line for line in tail if line.strip())
        )
    return started, time.time()


def name(command: list[str]) -> str:
    """What a person calls the launcher: ``torchrun`` for ``python -m torch.distributed.run``, else the program."""
    if len(command) > 2 and command[1] == "-m":
        return {"torch.distributed.run": "torchrun"}.get(command[2], command[2])
    return os.path.basename(command[0])


def _stop(process: subprocess.Popen) -> int:
    """End the launcher and every process it started (SIGTERM, then SIGKILL after 15 s); returns how many it had
    started.

    The workers are signalled directly, before the launcher: torchrun starts each in a session of its own, out of
    reach of the launcher's process group, and passes the signal on only if nothing interrupts its shutdown.
    """
    try:
        workers = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        workers = []
    for worker in workers:
        with contextlib.suppress(psutil.NoSuchProcess):
            worker.terminate()
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass
    _, alive = psutil.wait_procs(workers, timeout=5)
    for worker in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            worker.kill()
    return len(workers)
