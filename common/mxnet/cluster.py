"""The nodes of MXNet's parameter-server cluster (``KVSTORE="dist_sync"``), and a watch that stops all of them when one
leaves before the end.

MXNet's dist kvstore waits without a time limit. When one worker stops early (the stop button, Ctrl-C, a kernel
restart, a crash), the other workers wait for its gradients forever, and the servers and the scheduler wait for the
workers. So the scheduler also runs a *watch*, on the port after ``DMLC_PS_ROOT_PORT``, and every server and worker
keeps one TCP connection to it. A node that leaves before the end says why, or its connection closes (the operating
system closes it when a process dies). The watch then tells every other node to stop; each prints one line that says
what stopped and why, and exits. Once every worker has said it is done, nodes may leave: that is the normal end.

A scheduler or a server: ``DMLC_ROLE=scheduler python -m common.mxnet.cluster`` (or ``server``). A worker joins with
:func:`join` once its kvstore exists (``gluon_utils.create_kvstore``) and calls :func:`done` after its last use of it.
"""

from __future__ import annotations

import atexit
import itertools
import os
import socket
import sys
import threading
import time

from common.errors import InputError
from common.run import kernel

GRACE_SECONDS = 3  # a node whose watch went away without a word waits this long for its own normal exit
ANSWER_SECONDS = 5  # how long a node waits for the watch to take its connection, and then to welcome it


def watch_address() -> tuple[str, int]:
    """Where the watch listens: the scheduler's host, the port after the scheduler's."""
    try:
        return os.environ["DMLC_PS_ROOT_URI"], int(os.environ["DMLC_PS_ROOT_PORT"]) + 1
    except (KeyError, ValueError) as error:
        raise InputError(
            f"DMLC_PS_ROOT_URI and DMLC_PS_ROOT_PORT must name the scheduler's host and port ({error!r})."
        ) from None


def _say(line: str) -> None:
    """One line for whoever watches this node: its output, and the terminal or log of the process itself."""
    print(line, file=sys.stderr, flush=True)
    if sys.__stderr__ is not None and sys.stderr is not sys.__stderr__:  # inside a kernel: the server's terminal too
        print(line, file=sys.__stderr__, flush=True)


def _exit(line: str) -> None:
    _say(line)
    time.sleep(1)  # lets a kernel send the line to the notebook before the process ends
    os._exit(1)  # the main thread may be blocked inside MXNet's engine, where no exception can reach it


class Watch:
    """The scheduler's side: knows every node's connection, and when all workers are done."""

    def __init__(self, port: int, workers: int):
        self.workers = workers
        self.done: set[str] = set()
        self.nodes: dict[socket.socket, str] = {}
        self.lock = threading.Lock()
        self.stopping = False
        self.listener = socket.create_server(("", port))

    def serve(self) -> None:
        """Accept nodes in a background thread (the scheduler itself runs inside MXNet's import)."""
        threading.Thread(target=self._accept, daemon=True, name="mxnet-cluster-watch").start()

    @property
    def finished(self) -> bool:
        return len(self.done) >= self.workers

    def _accept(self) -> None:
        while True:
            connection, _ = self.listener.accept()
            threading.Thread(target=self._follow, args=(connection,), daemon=True).start()

    def _follow(self, connection: socket.socket) -> None:
        name, why = None, "its connection closed (the process ended or was killed)"
        try:
            for line in connection.makefile("r", encoding="utf-8"):
                word, _, rest = line.strip().partition(" ")
                if word == "join":
                    name = rest
                    with self.lock:
                        self.nodes[connection] = name
                    # the node's join returns on this answer: from then on, a departure anywhere reaches it
                    connection.sendall(b"welcome\n")
                elif word == "done":
                    with self.lock:
                        self.done.add(name)
                        if self.finished:
                            self._tell("finished")
                elif word == "left":
                    why = rest
                    break
        except OSError:  # reset by the node's host
            pass
        with self.lock:
            self.nodes.pop(connection, None)
            if name is None or name in self.done or self.finished or self.stopping:
                return
            self.stopping = True  # the first departure stops the cluster; the nodes it stops leave in its wake
            self._tell(f"stop {name} left the cluster before the end: {why}")
            told = len(self.nodes)
        _exit(f"Stopped the MXNet cluster: {name} left before the end ({why}); told the {told} other node(s) to stop.")

    def _tell(self, line: str) -> None:
        for connection in list(self.nodes):
            try:
                connection.sendall(f"{line}\n".encode())
            except OSError:
                pass


class Member:
    """A server's or a worker's side: one connection to the watch, and what to do when it says stop."""

    def __init__(self, name: str, connection: socket.socket):
        self.name = name
        self.connection = connection
        self.finished = False  # every worker is done: the watch may go away
        self.done = False  # this worker's last use of the kvstore is over
        self.left = False  # this node left before the end (interrupted, or its process exits)
        connection.sendall(f"join {name}\n".encode())
        self.lines = connection.makefile("r", encoding="utf-8")
        # Wait for the watch's welcome: a node it has not registered yet would miss a stop sent in the meantime,
        # and would learn of it only when the scheduler goes away.
        try:
            first = self.lines.readline()
        except TimeoutError:
            host, port = connection.getpeername()[:2]
            connection.close()
            raise InputError(
                f"{name} got no answer within {ANSWER_SECONDS} s from the MXNet cluster watch at {host}:{port}, the "
                "port after DMLC_PS_ROOT_PORT: another program listens there, or the scheduler runs another version "
                "of this project. Start the scheduler from this checkout (`DMLC_ROLE=scheduler python -m "
                "common.mxnet.cluster`), or choose a DMLC_PS_ROOT_PORT whose next port is free, on every node."
            ) from None
        connection.settimeout(None)
        threading.Thread(target=self._listen, args=(first,), daemon=True, name="mxnet-cluster-member").start()

    def send(self, line: str) -> None:
        try:
            self.connection.sendall(f"{line}\n".encode())
        except OSError:
            pass

    def leave(self, why: str) -> None:
        """Leave before the end: the watch stops every other node."""
        if not (self.left or self.done):
            self.left = True
            self.send(f"left {why}")
            self.connection.close()

    def interrupted(self) -> None:
        """The stop button ended a cell of this worker's kernel, which lives on: leave, and say what that stops."""
        if not (self.left or self.done):
            self.leave("it was interrupted")
            _say(
                f"Interrupted: {self.name} left the MXNet cluster, so the scheduler, the servers and the other workers "
                "stop too. To train again, restart this kernel and start the whole cluster anew."
            )

    def finish(self) -> None:
        if not (self.left or self.done):
            self.done = True
            self.send("done")

    def _listen(self, first: str) -> None:
        try:
            for line in itertools.chain([first], self.lines):  # the welcome, or what came instead
                word, _, rest = line.strip().partition(" ")
                if word == "finished":
                    self.finished = True
                elif word == "stop" and not self.left:  # a done worker waits for the others at its exit
                    _exit(f"Stopped {self.name}: {rest}.")
        except OSError:
            pass
        if self.finished or self.left:
            return
        time.sleep(GRACE_SECONDS)  # the scheduler may just have ended normally a moment before the last "finished"
        _exit(f"Stopped {self.name}: the MXNet scheduler's watch went away (the scheduler stopped) before the end.")


_member: Member | None = None


def connect(timeout: float) -> socket.socket | None:
    """A connection to the watch, trying until ``timeout`` (a scheduler may start after its servers)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return socket.create_connection(watch_address(), timeout=ANSWER_SECONDS)
        except OSError:
            if time.monotonic() > deadline:
                return None
            time.sleep(0.5)


def check_not_joined() -> None:
    """MXNet joins a cluster once per process: a second kvstore in a kernel that joined one would wait forever."""
    if _member is not None:
        raise InputError(
            f"This kernel already joined an MXNet cluster as {_member.name}; MXNet cannot join another one in the same "
            "process. Restart the kernel, start the scheduler and the servers again, then run this notebook."
        )


def join(name: str, timeout: float = 10) -> Member | None:
    """Join the watch as node ``name``; ``None`` (with a warning) when the scheduler runs without one."""
    global _member
    connection = connect(timeout)
    if connection is None:
        host, port = watch_address()
        _say(
            f"Warning: no MXNet cluster watch at {host}:{port}, so if a node stops early the others wait forever. "
            "Start the scheduler with `DMLC_ROLE=scheduler python -m common.mxnet.cluster`."
        )
        return None
    _member = Member(name, connection)
    atexit.register(_member.leave, "its process exited (a kernel restart or shutdown)")
    kernel.on_interrupt(_member.interrupted)
    return _member


def done() -> None:
    """This worker's last use of the kvstore is over: from now on it may leave without stopping the others."""
    if _member is not None:
        _member.finish()


def main() -> None:
    """Run this process as the node ``DMLC_ROLE`` names: the scheduler (with the watch) or a server."""
    role = os.environ.get("DMLC_ROLE")
    if role == "scheduler":
        Watch(watch_address()[1], int(os.environ.get("DMLC_NUM_WORKER", "1"))).serve()
    elif role == "server":
        threading.Thread(target=_join_when_up, args=(f"server on {socket.gethostname()}",), daemon=True).start()
    else:
        raise SystemExit(
            f"DMLC_ROLE={role!r}: this command runs a scheduler or a server (DMLC_ROLE=scheduler or server); "
            "workers run the notebook."
        )
    from common.mxnet import imports as mxnet_import

    mxnet_import.load()  # importing MXNet in that role runs the node until the workers stop it


def _join_when_up(name: str) -> None:
    join(name, timeout=120)  # the scheduler may start after the server


if __name__ == "__main__":
    main()
