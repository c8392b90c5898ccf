"""Several "nodes" of a distributed run on one machine, for the multi-node tests: free ports, a time bound, nothing
left running.

Framework-neutral: the launch commands and environment variables come from each framework's helpers.
A real multi-node run starts the same commands on different hosts; on one machine they are processes.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil


class LaunchTimeout(AssertionError):
    """A launched node did not finish within its time bound (the message names it)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on now: the kernel picks one for a socket bound to port 0."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` different free ports (held open together, so the kernel cannot hand out one twice)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def assert_port_free(port: int) -> None:
    """Raise if a process still listens on ``port``, which would stop the next launcher's server from binding it.
    Read from the kernel's socket table rather than by binding the port: a connection of some other program that
    happens to use the same (ephemeral) port number is not a leftover of the test."""
    listening = [
        connection
        for connection in psutil.net_connections("tcp")
        if connection.status == psutil.CONN_LISTEN and connection.laddr.port == port
    ]
    assert not listening, f"port {port} is still listened on (process {[c.pid for c in listening]})"


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 60, node: Node | None = None) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``timeout`` s, or at once if ``node`` exits first
    (with its last lines), rather than wait out the time for a process that is gone."""
    deadline = time.monotonic() + timeout
    while not condition():
        if node is not None and node.process.poll() is not None:
            raise AssertionError(f"{node.name} exited ({node.process.returncode}) before {what}:\n{node.tail()}")
        if time.monotonic() > deadline:
            lines = "" if node is None else f"; last lines of {node.name}:\n{node.tail()}"
            raise LaunchTimeout(f"waited {timeout:.0f} s for {what}{lines}")
        time.sleep(0.1)


@dataclass
class Node:
    """One launched process (a node's launcher, a server, a scheduler) and where its output goes."""

    name: str
    command: list[str]
    env: dict[str, str]
    log: Path
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self, lines: int = 25) -> str:
        return "\n".join(self.output.splitlines()[-lines:])


class Cluster:
    """Start named processes, wait for them with a time bound, and stop every one of them on the way out.

    Use it as a context manager: leaving the block (a failed assertion, a timeout, Ctrl-C) kills each
    process group that is still alive, so a failing test leaves no launcher, worker or server behind.
    """

    def __init__(self, log_dir: Path):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.nodes: list[Node] = []

    def start(
        self, name: str, command: list[str], env: dict[str, str] | None = None, cwd=None, core: int | None = None
    ) -> Node:
        """Start ``command`` as node ``name``; ``core`` pins it (and all it starts) to that CPU core, as if it were a
        host of its own: two workers that each count every core of this machine as theirs oversubscribe it."""
        node = Node(name, [str(part) for part in command], dict(env or {}), self.log_dir / f"{name}.log")
        allowed = sorted(os.sched_getaffinity(0))  # a container may allow other cores than 0 and 1
        pin = None if core is None else {allowed[core % len(allowed)]}

        def as_on_a_host() -> None:
            # Ctrl-C must reach a node as it reaches a process started at a terminal, whatever started this test:
            # a shell that runs the suite in the background (`make test &`, nohup, CI) ignores SIGINT, and its
            # children inherit that, so a node that ignores it would finish its run instead of stopping.
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            if pin is not None:
                os.sched_setaffinity(0, pin)

        with node.log.open("wb") as log:
            # Own session: the launcher and every worker it starts form one process group to kill.
            node.process = subprocess.Popen(
                node.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **node.env},
                cwd=cwd,
                start_new_session=True,
                preexec_fn=as_on_a_host,
            )
        self.nodes.append(node)
        return node

    def wait(self, nodes: list[Node], timeout: float) -> dict[str, int]:
        """Exit codes of ``nodes`` by name; raises :class:`LaunchTimeout` naming every node still running."""
        deadline = time.monotonic() + timeout
        while any(node.process.poll() is None for node in nodes):
            if time.monotonic() > deadline:
                hung = [node for node in nodes if node.process.poll() is None]
                details = "\n".join(f"--- {node.name}: {' '.join(node.command)}\n{node.tail()}" for node in hung)
                raise LaunchTimeout(
                    f"{', '.join(node.name for node in hung)} did not finish within {timeout:.0f} s; "
                    f"last lines:\n{details}"
                )
            time.sleep(0.2)
        return {node.name: node.process.returncode for node in nodes}

    def check(self, nodes: list[Node], timeout: float) -> None:
        """Wait for ``nodes``; fail naming each one that exited with an error, with its last lines."""
        codes = self.wait(nodes, timeout)
        failed = [node for node in nodes if codes[node.name] != 0]
        if failed:
            details = "\n".join(
                f"--- {n.name} (exit {codes[n.name]}): {' '.join(n.command)}\n{n.tail()}" for n in failed
            )
            raise AssertionError(f"{', '.join(n.name for n in failed)} failed:\n{details}")

    def stop(self) -> None:
        """SIGTERM each live process group, then SIGKILL whatever has not exited after a grace period."""
        for node in self.nodes:
            _signal_group(node.process, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for node in self.nodes:
            try:
                node.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            # Children of a launcher that already exited can outlive it in the group: kill the group regardless.
            _signal_group(node.process, signal.SIGKILL)
            node.process.wait()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
