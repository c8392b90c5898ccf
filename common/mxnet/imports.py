"""Import MXNet 1.9.1 (a retired framework) in this project's environment: the one place that patches numpy for it.

MXNet 1.9.1 still uses ``numpy.bool``, an alias that numpy 1.24 removed; it meant the builtin ``bool``.
Its engine also reads its thread count once, when it is imported, so the count is passed here.

MXNet runs its operators in its engine's threads, each with a team of OpenMP threads. A large ``asnumpy()`` (the
weights read for the notebook's fingerprint, say) runs an OpenMP copy in the thread that calls it, whose team then
stays: with more OpenMP threads than cores, libgomp stops letting idle threads spin, and every later operator waits
for its team to wake. The Gluon notebook's step on one ``mx.cpu(0)`` on 2 cores fell from about 82 to 54-60 images/s
for the rest of the process after one ``asnumpy()`` of a million floats, and stayed at 82-83 when the calling thread
copies with one OpenMP thread, as :func:`load` sets (the engine's threads keep theirs).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import warnings

import numpy


def load(threads: int | None = None):
    """Import and return ``mxnet``; ``threads`` sets its OpenMP threads if MXNet is not imported yet.

    MXNet defaults to half of the cores (it assumes hyper-threading); simulated CPU devices pass their
    share instead. A second call returns the module already imported and cannot change the count.
    """
    if "mxnet" in sys.modules:
        if threads and os.environ.get("OMP_NUM_THREADS") != str(threads):
            warnings.warn(
                f"MXNet was imported with OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}; it keeps those "
                f"threads until the kernel restarts (asked for {threads}).",
                stacklevel=2,
            )
        return sys.modules["mxnet"]
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    numpy.bool = bool
    # MXNet imports distutils; the standard library's copy rather than setuptools' shim keeps Chainer, which needs
    # the former (see common/chainer_import.py), importable in the same process
    with contextlib.suppress(ImportError):
        import _distutils_hack

        _distutils_hack.remove_shim()
    import mxnet

    with contextlib.suppress(OSError):  # MXNet's Linux wheels link the system's libgomp
        ctypes.CDLL("libgomp.so.1").omp_set_num_threads(1)  # this thread's OpenMP regions only
    return mxnet
