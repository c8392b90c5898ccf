"""Import Chainer 7.8.1 (a retired framework) here: ``from common.chainer_import import chainer, chainermn``.

Chainer's import-time environment check imports ``numpy.distutils``, which needs ``distutils.msvccompiler``. The
setuptools 80 this project pins installs a ``distutils-precedence.pth`` hook that serves setuptools' own copy of
distutils, and that copy no longer has ``msvccompiler``: ``import chainer`` fails. Python 3.11 still ships the stdlib
distutils (with ``msvccompiler``), so switching the hook off before the first ``import distutils`` is enough.
Chainer also imports ``pkg_resources``, which warns that it is deprecated; that one warning is silenced here.

Every notebook, script and test imports Chainer through this module, so the fix lives in one place.
"""

from __future__ import annotations

import sys
import warnings


def _use_stdlib_distutils() -> None:
    """Switch off setuptools' distutils hook; refuse if setuptools' distutils is already imported."""
    loaded = sys.modules.get("distutils")
    if loaded is not None and "_distutils" in (getattr(loaded, "__file__", "") or ""):
        raise ImportError(
            f"setuptools' copy of distutils ({loaded.__file__}) was imported before Chainer, and numpy.distutils "
            "cannot use it: import common.chainer_import (or Chainer) before anything that imports setuptools or "
            "distutils, or restart the kernel."
        )
    try:
        import _distutils_hack
    except ImportError:  # no setuptools hook installed: the stdlib distutils is what gets imported anyway
        return
    _distutils_hack.remove_shim()


if "chainer" not in sys.modules:
    _use_stdlib_distutils()
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="pkg_resources is deprecated", category=UserWarning)
    # numpy.distutils and the stdlib distutils announce their own deprecation (both still work on Python 3.11)
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"(numpy\.distutils|distutils|chainer)")
    import chainer
    import chainermn

__all__ = ["chainer", "chainermn"]
