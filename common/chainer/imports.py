"""Import Chainer 7.8.1 (a retired framework) here: ``from common.chainer.imports import chainer, chainermn``.

Chainer's import-time environment check imports ``numpy.distutils``, which needs ``distutils.msvccompiler``. The
setuptools 80 this project pins installs a ``distutils-precedence.pth`` hook that serves setuptools' own copy of
distutils, and that copy no longer has ``msvccompiler``: ``import chainer`` fails. Python 3.11 still ships the stdlib
distutils (with ``msvccompiler``), so switching the hook off before the first ``import distutils`` is enough.
Chainer also imports ``pkg_resources``, which warns that it is deprecated; that one warning is silenced here.

On a GPU box, CuPy 13 (the newest that accepts numpy 1.x) links the CUDA libraries by their names
(``libcublas.so.11``, ``libcudnn.so.8``, ``libnvrtc.so.11.2``, ...) but does not look for them in NVIDIA's pip packages
(``nvidia-*-cu11``, where envs/mxnet-chainer/cuda11.txt installs them): they are loaded from there first, by name, so
the dynamic loader finds them already loaded when CuPy asks. No system CUDA toolkit is needed.

Every notebook, script and test imports Chainer through this module, so the fixes live in one place.
"""

from __future__ import annotations

import ctypes
import sys
import warnings
from pathlib import Path


def _use_stdlib_distutils() -> None:
    """Switch off setuptools' distutils hook; refuse if setuptools' distutils is already imported."""
    loaded = sys.modules.get("distutils")
    if loaded is not None and "_distutils" in (getattr(loaded, "__file__", "") or ""):
        raise ImportError(
            f"setuptools' copy of distutils ({loaded.__file__}) was imported before Chainer, and numpy.distutils "
            "cannot use it: import common.chainer.imports (or Chainer) before anything that imports setuptools or "
            "distutils, or restart the kernel."
        )
    try:
        import _distutils_hack
    except ImportError:  # no setuptools hook installed: the stdlib distutils is what gets imported anyway
        return
    _distutils_hack.remove_shim()


def pip_cuda_libraries(roots: list[str]) -> list[Path]:
    """The versioned shared libraries (``lib*.so.<n>``) of NVIDIA's pip packages under ``roots`` (the ``nvidia``
    namespace package's folders), in an order where each one's CUDA dependencies come first."""
    first = ("cuda_runtime", "cublas", "cuda_nvrtc", "nvjitlink", "cusparse", "cufft", "curand", "cusolver")
    rank = {name: index for index, name in enumerate(first)}
    found = [path for root in roots for path in Path(root).glob("*/lib/lib*.so.*") if path.suffix[1:].isdigit()]
    # libcublasLt before libcublas, and libcudnn's parts before libcudnn
    return sorted(found, key=lambda path: (rank.get(path.parent.parent.name, len(first)), -len(path.name), path.name))


def _load_pip_cuda_libraries() -> list[str]:
    """Load every library of NVIDIA's pip packages, globally; those that fail (no GPU driver) are left for CuPy to
    report. Returns the names loaded."""
    try:
        import nvidia
    except ImportError:  # the CPU build: no NVIDIA packages
        return []
    loaded = []
    for path in pip_cuda_libraries(list(nvidia.__path__)):
        try:
            ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            loaded.append(path.name)
        except OSError:
            pass
    return loaded


if "chainer" not in sys.modules:
    _use_stdlib_distutils()
    _load_pip_cuda_libraries()
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="pkg_resources is deprecated", category=UserWarning)
    # numpy.distutils and the stdlib distutils announce their own deprecation (both still work on Python 3.11)
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"(numpy\.distutils|distutils|chainer)")
    import chainer
    import chainermn

__all__ = ["chainer", "chainermn"]
