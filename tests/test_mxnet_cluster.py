"""The watch of an MXNet parameter-server cluster (common.mxnet.cluster): a node that leaves before the end stops every
other node within seconds, each with one line that says why, and frees the ports; a normal end stops nobody.

The scheduler and the server are MXNet's own, started as the notebook prints them (``python -m common.mxnet.cluster``).
The workers here only join the watch, without training: MXNet itself then waits for them, as it waits for a worker that
is gone. tests/test_multinode.py interrupts a real worker of a real cluster.
"""

import os
import re
import signal
import socket
import subprocess
import textwrap
import time

import cluster as multinode
import psutil
import pytest
from elsewhere import python_of
from jupyter_client.manager import start_new_kernel
from test_kernel_interrupts import reply_and_output

from common.errors import InputError
from common.mxnet import cluster as mxnet_cluster
from common.run.environments import ENVIRONMENTS

pytestmark = pytest.mark.environments("mxnet-chainer")
KERNEL = ENVIRONMENTS["mxnet-chainer"].kernel
WORKER = textwrap.dedent(
    """
    import sys, time
    from common.mxnet import cluster as mxnet_cluster
    mxnet_cluster.join(sys.argv[1])
    print("joined", flush=True)
    if sys.argv[2:] == ["done"]:
        mxnet_cluster.done()
        time.sleep(0.5)
        sys.exit(0)
    time.sleep(120)
    """
)


@pytest.fixture
def roles():
    """The ``DMLC_*`` variables of one server and two workers on this machine."""
    return {
        "DMLC_PS_ROOT_URI": "127.0.0.1",
        "DMLC_PS_ROOT_PORT": str(multinode.free_port()),
        "DMLC_NUM_SERVER": "1",
        "DMLC_NUM_WORKER": "2",
        "OMP_NUM_THREADS": "1",
    }


@pytest.fixture
def nodes(tmp_path):
    with multinode.Cluster(tmp_path / "logs") as started:
        yield started


def watched(roles) -> int:
    """How many connections the watch (the port after the scheduler's) has accepted now."""
    port = int(roles["DMLC_PS_ROOT_PORT"]) + 1
    return sum(c.laddr.port == port and c.status == "ESTABLISHED" for c in psutil.net_connections("tcp"))


def node() -> list[str]:
    """A scheduler or server, in the MXNet environment."""
    return [python_of("mxnet-chainer"), "-m", "common.mxnet.cluster"]


def start_cluster(nodes, roles) -> tuple[multinode.Node, multinode.Node]:
    """A scheduler with its watch and a server that joined it."""
    scheduler = nodes.start("scheduler", node(), env={**roles, "DMLC_ROLE": "scheduler"})
    server = nodes.start("server", node(), env={**roles, "DMLC_ROLE": "server"})
    multinode.wait_until(lambda: watched(roles) == 1, "the server to join the watch")
    return scheduler, server


def start_worker(nodes, roles, index: int, *args: str) -> multinode.Node:
    name = f"worker {index}"
    worker = nodes.start(name, [python_of("mxnet-chainer"), "-c", WORKER, name, *args], env=roles)
    multinode.wait_until(lambda: "joined" in worker.output, f"{name} to join", node=worker)
    return worker


def assert_ports_free(roles) -> None:
    for port in (int(roles["DMLC_PS_ROOT_PORT"]), int(roles["DMLC_PS_ROOT_PORT"]) + 1):
        multinode.assert_port_free(port)


def test_a_worker_that_dies_stops_the_scheduler_the_server_and_the_other_worker(nodes, roles):
    scheduler, server = start_cluster(nodes, roles)
    workers = [start_worker(nodes, roles, index) for index in (0, 1)]
    workers[0].process.send_signal(signal.SIGKILL)  # a crash or a kernel restart: not a word, the connection closes

    codes = nodes.wait([scheduler, server, workers[1]], timeout=15)
    assert codes == {"scheduler": 1, "server": 1, "worker 1": 1}, "every other node stops, with an error"
    # The server can leave at the same moment (about 1 run in 20 here, the watch read the server's closed connection
    # first): the watch names the departure it reads first, once, to every node
    stopped = re.search(
        r"Stopped the MXNet cluster: (worker 0|server on \S+) left before the end \(its connection "
        r"closed",
        scheduler.output,
    )
    assert stopped, scheduler.output
    assert f"Stopped worker 1: {stopped[1]} left the cluster before the end" in workers[1].output
    assert "Stopped server on " in server.output
    assert_ports_free(roles)


def test_a_stopped_scheduler_stops_the_nodes_after_a_grace_period(nodes, roles):
    scheduler, server = start_cluster(nodes, roles)
    worker = start_worker(nodes, roles, 0)
    scheduler.process.send_signal(signal.SIGKILL)
    codes = nodes.wait([server, worker], timeout=15)
    assert codes == {"server": 1, "worker 0": 1}
    assert "the MXNet scheduler's watch went away" in worker.output and "watch went away" in server.output


def test_workers_that_are_done_leave_without_stopping_anyone(nodes, roles):
    scheduler, server = start_cluster(nodes, roles)
    workers = [start_worker(nodes, roles, index, "done") for index in (0, 1)]
    assert nodes.wait(workers, timeout=15) == {"worker 0": 0, "worker 1": 0}
    time.sleep(1)  # time enough for a wrong stop to arrive
    assert scheduler.process.poll() is None and server.process.poll() is None, "a normal end stopped a node"
    assert "Stopped" not in scheduler.output + server.output


def test_the_stop_button_in_a_worker_kernel_leaves_and_stops_the_others(nodes, roles, tmp_path):
    scheduler, server = start_cluster(nodes, roles)
    other = start_worker(nodes, roles, 1)
    worker_env = {**os.environ, **roles, "DMLC_ROLE": "worker"}
    manager, client = start_new_kernel(kernel_name=KERNEL, cwd=str(tmp_path), env=worker_env)
    try:
        client.execute_interactive("from common.mxnet import cluster\ncluster.join('worker 0')", timeout=30)
        # a training loop; an interrupt before the cell runs would find the kernel idle, which ignores it
        msg_id = client.execute("import time\nopen('looping', 'w').close()\nwhile True: time.sleep(0.1)")
        multinode.wait_until(lambda: watched(roles) == 3, "worker 0's kernel to join the watch")
        multinode.wait_until((tmp_path / "looping").exists, "worker 0's training loop to start")
        manager.interrupt_kernel()
        reply, printed = reply_and_output(client, msg_id, timeout=30)
        assert reply["ename"] == "KeyboardInterrupt"
        assert "Interrupted: worker 0 left the MXNet cluster, so the scheduler, the servers and the other" in printed

        codes = nodes.wait([scheduler, server, other], timeout=15)
        assert codes == {"scheduler": 1, "server": 1, "worker 1": 1}
        assert "worker 0 left before the end (it was interrupted)" in scheduler.output
        assert_ports_free(roles)

        # the kernel lives on, and refuses to join a cluster a second time (MXNet cannot) rather than wait forever
        reply = client.execute_interactive("from common.mxnet import utils as gu\ngu.create_kvstore('dist_sync')")
        assert reply["content"]["ename"] == "InputError"
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def test_a_scheduler_or_server_command_with_another_role_says_what_it_runs():
    env = {**os.environ, "DMLC_ROLE": "worker"}
    result = subprocess.run(node(), env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "this command runs a scheduler or a server" in result.stderr


def test_a_watch_that_never_answers_stops_the_worker_naming_the_port_and_the_fix(monkeypatch):
    """Another program on the watch's port takes the connection and says nothing: the worker stops before training,
    rather than waiting for a welcome that never comes or failing on a bare timeout."""
    with socket.create_server(("127.0.0.1", 0)) as silent:  # the system takes connections that it never accepts
        host, port = silent.getsockname()
        monkeypatch.setenv("DMLC_PS_ROOT_URI", host)
        monkeypatch.setenv("DMLC_PS_ROOT_PORT", str(port - 1))
        monkeypatch.setattr(mxnet_cluster, "ANSWER_SECONDS", 0.5)
        with pytest.raises(InputError, match=rf"worker 0 got no answer within 0.5 s .* at {host}:{port}, .*DMLC_ROLE"):
            mxnet_cluster.join("worker 0", timeout=1)
    assert mxnet_cluster._member is None
