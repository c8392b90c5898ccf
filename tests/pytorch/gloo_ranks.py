"""N gloo ranks on this machine for the PyTorch unit tests, each joined as torchrun would start it."""

import os
import socket

from common.pytorch import utils as tu


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def join(rank: int, world_size: int, port: int) -> tu.Process:
    """This spawned process as rank ``rank`` of ``world_size`` (one thread each), through the notebooks' own set-up."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    return tu.setup_distributed()
