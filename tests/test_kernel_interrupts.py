"""The stop button and a kernel restart during a launched training, in a real Jupyter kernel, for each launcher the
notebooks use: every launched process ends within seconds, the rendezvous port is free, one line says what was
stopped, and the same launch then runs again in the same kernel.

The TensorFlow and MXNet notebooks train inside the kernel, so what they leave after an interrupt on one machine is the
kernel's state, which common.run.cell_order guards. Their multi-machine workers are started by hand, one per host: the
stop button in one worker's kernel must stop the other workers, which would otherwise wait for it forever (TensorFlow
here, MXNet in tests/test_mxnet_cluster.py).
"""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from cluster import Cluster, assert_port_free, free_port, free_ports, wait_until
from elsewhere import python_of
from jupyter_client.manager import start_new_kernel

from common.run.environments import ENVIRONMENTS
from common.run.launch import tf_config

WORKER = """
import os, pathlib, sys, time
pathlib.Path(sys.argv[1], str(os.getpid())).touch()
print("worker up", flush=True)
time.sleep(float(sys.argv[2]))
"""
# launcher: its environment, and the code that builds its command of two workers in that environment's kernel, as a
# notebook does; torchrun meets at a fixed port, as on several machines, so that the test can see that port freed
LAUNCHERS = {
    "torchrun": (
        "pytorch",
        "from common.pytorch import utils as tu\n"
        "command = tu.torchrun_multinode_command({script!r}, 1, 2, '127.0.0.1:{port}', 'interrupt', *{rest!r})",
    ),
    "mpiexec": (
        "mxnet-chainer",
        "from common.chainer import utils as cu\ncommand = cu.mpiexec_command({script!r}, 2, *{rest!r})",
    ),
}
LAUNCHER_PARAMS = [pytest.param(name, marks=pytest.mark.environments(env)) for name, (env, _) in LAUNCHERS.items()]
# A MultiWorkerMirroredStrategy worker in a loop of all-reduces, as the TensorFlow notebook's training loop
TF_WORKER = """
from common.tensorflow import utils as tfu

tf = tfu.tf
strategy = tfu.make_strategy("multi_worker", [], "cpu")
weight = tf.Variable(1.0)


@tf.function
def step():
    return strategy.reduce("SUM", strategy.run(lambda: tf.identity(weight)), axis=None)


step()
print("training", flush=True)
"""


@pytest.fixture
def kernel(tmp_path, launcher):
    """A kernel of the launcher's environment."""
    environment, _ = LAUNCHERS[launcher]
    manager, client = start_new_kernel(kernel_name=ENVIRONMENTS[environment].kernel, cwd=str(tmp_path))
    try:
        yield manager, client
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def start_launch(client, launcher: str, script, port: int, *rest) -> str:
    """Build the command of two workers in the kernel, as a notebook does, and run it."""
    _, build = LAUNCHERS[launcher]
    rest = [str(item) for item in rest]
    code = build.format(script=str(script), port=port, rest=rest)
    return client.execute(f"{code}\nfrom common.run import launch\nlaunch.run(command)")


def reply_and_output(client, msg_id: str, timeout: float) -> tuple[dict, str]:
    """The execute reply of ``msg_id`` and the text the cell printed."""
    reply = client.get_shell_msg(timeout=timeout)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = client.get_shell_msg(timeout=timeout)
    text = []
    while True:
        message = client.get_iopub_msg(timeout=5)
        if message["parent_header"].get("msg_id") != msg_id:
            continue
        if message["msg_type"] == "stream":
            text.append(message["content"]["text"])
        if message["msg_type"] == "status" and message["content"]["execution_state"] == "idle":
            return reply["content"], "".join(text)


def launched(manager) -> list[psutil.Process]:
    return psutil.Process(manager.provisioner.process.pid).children(recursive=True)


def assert_all_gone(processes: list[psutil.Process], timeout: float) -> None:
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"still running {timeout:.0f} s later: {[p.cmdline()[:4] for p in alive]}"


def launch_two_workers(kernel, folder, launcher: str) -> tuple[str, Path, int, list[psutil.Process]]:
    """Start a launch of two sleeping workers in the kernel and wait until both run: its message id, the worker
    script, the rendezvous port and the processes it started."""
    manager, client = kernel
    script, port = folder / "worker.py", free_port()
    script.write_text(textwrap.dedent(WORKER))
    (folder / "up").mkdir()
    msg_id = start_launch(client, launcher, script, port, folder / "up", 120)
    wait_until(lambda: len(list((folder / "up").iterdir())) == 2, "both workers to start")
    return msg_id, script, port, launched(manager)


@pytest.mark.parametrize("launcher", LAUNCHER_PARAMS)
def test_stop_button_ends_the_launch_says_so_and_the_launch_runs_again(kernel, tmp_path, launcher):
    manager, client = kernel
    msg_id, script, port, processes = launch_two_workers(kernel, tmp_path, launcher)
    interrupted = time.monotonic()
    manager.interrupt_kernel()  # what the stop button sends
    reply, printed = reply_and_output(client, msg_id, timeout=30)
    assert reply["status"] == "error" and reply["ename"] == "Interrupted"
    assert time.monotonic() - interrupted < 20, "the cell returned within seconds"
    (shown,) = reply["traceback"]  # one line in place of a traceback into common/run/launch.py
    assert re.fullmatch(rf"Interrupted: stopped {launcher} and the \d process\(es\) it started\.", shown)
    assert_all_gone(processes, timeout=5)
    assert_port_free(port)

    (tmp_path / "again").mkdir()
    msg_id = start_launch(client, launcher, script, port, tmp_path / "again", 0)
    reply, printed = reply_and_output(client, msg_id, timeout=120)
    assert reply["status"] == "ok", printed[-2000:]
    assert printed.count("worker up") == 2


@pytest.mark.parametrize("launcher", LAUNCHER_PARAMS)
def test_a_kernel_restart_ends_the_launch(kernel, tmp_path, launcher):
    manager, _ = kernel
    _, _, port, processes = launch_two_workers(kernel, tmp_path, launcher)
    manager.restart_kernel(now=True)  # Kernel → Restart: the kernel is killed, with no cleanup of its own
    assert_all_gone(processes, timeout=10)
    assert_port_free(port)


# A launcher that, like torchrun interrupted in its own shutdown, passes no signal on: its workers run in sessions of
# their own, and it waits for them with SIGTERM ignored
DEAF_LAUNCHER = """
import signal, subprocess, sys
worker = [sys.executable, "-u", *sys.argv[1:]]
workers = [subprocess.Popen(worker, start_new_session=True) for _ in range(2)]
signal.signal(signal.SIGTERM, signal.SIG_IGN)
for process in workers:
    process.wait()
"""


def start_deaf_launch(folder: Path) -> tuple[subprocess.Popen, list[psutil.Process]]:
    """A "kernel" (a Python process, its output piped) running :data:`DEAF_LAUNCHER` with two sleeping workers, once
    both run: the kernel, and every process below it."""
    script, launcher, up = folder / "worker.py", folder / "launcher.py", folder / "up"
    script.write_text(textwrap.dedent(WORKER))
    launcher.write_text(DEAF_LAUNCHER)
    up.mkdir()
    command = [sys.executable, str(launcher), str(script), str(up), "120"]
    # SIGINT raises KeyboardInterrupt, as ipykernel sets it while a cell runs: a shell that starts pytest in the
    # background leaves SIGINT ignored, and Python then installs no handler of its own
    code = "import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\nfrom common.run import launch\n"
    kernel = subprocess.Popen(
        [sys.executable, "-c", f"{code}launch.run({command!r})"],
        cwd=Path(__file__).parents[1],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_until(lambda: len(list(up.iterdir())) == 2, "both workers to start")
    return kernel, psutil.Process(kernel.pid).children(recursive=True)


def test_the_stop_ends_workers_that_the_launcher_does_not(tmp_path):
    """The Jupyter kernel's part of a restart, without Jupyter: the interrupt that it sends first."""
    kernel, launched = start_deaf_launch(tmp_path)
    kernel.send_signal(signal.SIGINT)
    assert_all_gone(launched, timeout=5)
    printed, _ = kernel.communicate(timeout=30)
    assert "Interrupted: stopped python" in printed and "the 2 process(es)" in printed, printed


def test_a_killed_kernel_ends_workers_that_the_launcher_does_not(tmp_path):
    """The kill that a restart sends, at once, with no stop before it: the reaper ends the launch."""
    kernel, launched = start_deaf_launch(tmp_path)
    kernel.kill()
    kernel.communicate()
    assert_all_gone(launched, timeout=10)  # the launcher ignores SIGTERM: it gets SIGKILL 5 s later


@pytest.fixture
def tensorflow_workers(tmp_path):
    """Worker 0 of two in a kernel, worker 1 a process, both in a loop of all-reduces: (kernel, client, its message
    id, worker 1's node)."""
    workers = [f"127.0.0.1:{port}" for port in free_ports(2)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    loop = TF_WORKER + "while True:\n    step()\n"
    with Cluster(tmp_path / "logs") as nodes:
        worker = [python_of("tensorflow"), "-c", loop]
        other = nodes.start("worker 1", worker, env={**env, "TF_CONFIG": tf_config(workers, 1)})
        manager, client = start_new_kernel(
            kernel_name=ENVIRONMENTS["tensorflow"].kernel,
            cwd=str(tmp_path),
            env={**env, "TF_CONFIG": tf_config(workers, 0)},
        )
        try:
            msg_id = client.execute(loop)
            wait_until(lambda: "training" in other.output, "worker 1's first all-reduce", 120, node=other)
            yield manager, client, msg_id, other
        finally:
            client.stop_channels()
            manager.shutdown_kernel(now=True)


@pytest.mark.environments("tensorflow")
def test_stop_button_in_a_tensorflow_worker_stops_the_other_workers(tensorflow_workers):
    manager, client, msg_id, other = tensorflow_workers
    manager.interrupt_kernel()
    reply, printed = reply_and_output(client, msg_id, timeout=60)
    assert reply["ename"] == "KeyboardInterrupt"
    assert "Interrupted: worker 0 told the other workers to stop." in printed
    assert other.process.wait(timeout=15) == 1
    assert "CancelledError" in other.output and "worker 0 was interrupted (the stop button)" in other.output


@pytest.mark.environments("tensorflow")
def test_a_tensorflow_worker_whose_kernel_restarts_stops_the_other_workers(tensorflow_workers):
    manager, _, _, other = tensorflow_workers
    manager.restart_kernel(now=True)  # the kernel is killed: TensorFlow's own heartbeats tell the other worker
    restarted = time.monotonic()
    assert other.process.wait(timeout=90) == 1
    print(f"worker 1 stopped {time.monotonic() - restarted:.1f} s after the restart")
    # the words depend on what noticed first (a heartbeat, or the all-reduce's own connection): the all-reduce failed
    assert "CollectiveReduceV2" in other.output and "Error" in other.output, other.tail()
