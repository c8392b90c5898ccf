"""The notebook launcher streams the workers' log and fails when any of them fails."""

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from common.errors import Interrupted
from common.run import launch

PY = sys.executable


def test_output_streams_through(capsys):
    launch.run([PY, "-c", "import sys; print('rank 0 ready'); sys.stdout.write('50%\\r100%\\n')"])
    assert capsys.readouterr().out == "rank 0 ready\n50%\r100%\n"


def test_environment_reaches_the_command(capsys):
    launch.run([PY, "-c", "import os; print(os.environ['OMP_NUM_THREADS'])"], env={"OMP_NUM_THREADS": "3"})
    assert capsys.readouterr().out == "3\n"


def test_failing_command_raises_with_its_last_lines():
    script = "import sys; print('epoch 1 done'); print('RuntimeError: rank 1 died', file=sys.stderr); sys.exit(3)"
    with pytest.raises(launch.LaunchError, match=r"exited with code 3(.|\n)*rank 1 died"):
        launch.run([PY, "-c", script])


def test_one_failing_torchrun_rank_fails_the_launch(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text("import os, sys\nsys.exit(5 if os.environ['RANK'] == '1' else 0)\n")
    command = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    with pytest.raises(launch.LaunchError, match="exited with code 1"):
        launch.run(command)


def test_interrupting_a_launch_ends_every_process_it_started_and_says_so(tmp_path):
    """What the stop button does to a cell running torchrun or mpiexec: SIGINT to the kernel, once the launch runs."""
    ready = tmp_path / "ready"  # the launched process's child, named once it runs
    script = (
        "import os, subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; "
        f"time.sleep(60)']); open({str(ready)!r} + '.tmp', 'w').write(str(child.pid)); "
        f"os.rename({str(ready)!r} + '.tmp', {str(ready)!r}); time.sleep(60)"
    )

    def interrupt():
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGINT)

    # Python's own handler, as in a kernel: a library imported by an earlier test may have replaced it
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=interrupt, daemon=True).start()
    try:
        with pytest.raises(Interrupted, match=r"^stopped python and the 1 process\(es\) it started\.$"):
            launch.run([PY, "-c", script])
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        _, alive = psutil.wait_procs([psutil.Process(int(ready.read_text()))], timeout=10)
    except psutil.NoSuchProcess:
        alive = []
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], "the launched process's child survived"


def test_a_killed_kernel_takes_its_launch_with_it(tmp_path):
    """A kernel restart kills the kernel outright, with no cleanup: torchrun and its workers must not outlive it."""
    worker = tmp_path / "worker.py"
    worker.write_text("import time\nprint('worker up', flush=True)\ntime.sleep(120)\n")
    torchrun = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(worker)]
    kernel = subprocess.Popen([PY, "-c", f"from common.run import launch; launch.run({torchrun!r})"],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    for line in kernel.stdout:
        if "worker up" in line:
            break
    launched = psutil.Process(kernel.pid).children(recursive=True)
    assert len(launched) >= 3, "torchrun and its two workers"
    kernel.kill()
    kernel.wait()
    gone, alive = psutil.wait_procs(launched, timeout=10)
    assert not alive, f"outlived the kernel: {[p.cmdline() for p in alive]}"
