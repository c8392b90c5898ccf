"""Nothing a launch started outlives it, even when its kernel is killed: ``python reaper.py PID``, started by
:func:`common.run.launch.run` beside each launch, in a session of its own.

It reads a pipe whose other end only the kernel holds. The end reads as closed once the kernel is done with the launch
or is gone: a kernel restart kills the kernel outright, with no cleanup of its own. Then this process ends every
process the launch started that still runs, workers first, then the launcher.

Why not leave it to the launcher: torchrun passes a SIGTERM on to its workers only if nothing interrupts its own
shutdown, and a second SIGTERM during it (the kernel's stop, then a signal sent as the kernel died) left both workers
running in about one restart of six here. The workers are remembered as the launch runs, since they may outlive the
launcher that started them. Run as a script, with psutil only, so any environment's Python can start it.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys

import psutil

POLL_S = 0.2  # how often the launch's processes are looked up: each one lives far longer than this


def watch(pid: int, pipe: int) -> None:
    """Wait for ``pipe`` to read as closed, remembering every process that ``pid`` starts, then end them all."""
    with contextlib.suppress(psutil.NoSuchProcess):
        launcher = psutil.Process(pid)
        started: dict[int, psutil.Process] = {}
        while True:
            readable, _, _ = select.select([pipe], [], [], POLL_S)
            with contextlib.suppress(psutil.NoSuchProcess):
                started.update((child.pid, child) for child in launcher.children(recursive=True))
            if readable and not os.read(pipe, 1):
                break
        end([*started.values(), launcher])


def end(processes: list[psutil.Process], grace_s: float = 5) -> None:
    """SIGTERM to each of ``processes`` still running, in order; SIGKILL to those still running ``grace_s`` later.
    psutil checks that each PID still names the process it saw, so a PID that was reused is left alone."""
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.terminate()
    _, alive = psutil.wait_procs(processes, timeout=grace_s)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


if __name__ == "__main__":
    watch(int(sys.argv[1]), sys.stdin.fileno())
