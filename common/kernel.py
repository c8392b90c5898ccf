"""The Jupyter kernel every notebook runs on: its name, defined here once, its installation, and what a worker does
when its cell is interrupted.

python -m common.kernel                  # into this environment (``make setup`` does this)
python -m common.kernel --prefix /tmp/j  # elsewhere; then JUPYTER_PATH=/tmp/j/share/jupyter finds it
"""

from __future__ import annotations

import argparse
import sys

NAME = "multigpu-notebooks"
DISPLAY_NAME = f"Python 3 ({NAME})"


def on_interrupt(callback) -> None:
    """Inside a Jupyter kernel, call ``callback()`` after the first cell that the stop button (or any KeyboardInterrupt)
    ends: the kernel lives on, so a process that is one of several workers must tell the others itself. Elsewhere an
    interrupt ends the process, which the other workers notice: nothing to do."""
    try:
        shell = get_ipython()  # noqa: F821 (defined inside IPython only)
    except NameError:
        return

    def after_cell(result) -> None:
        if isinstance(result.error_in_exec, KeyboardInterrupt):
            shell.events.unregister("post_run_cell", after_cell)  # IPython calls a copy of the list: safe here
            callback()

    shell.events.register("post_run_cell", after_cell)


def install(prefix: str = sys.prefix) -> str:
    """Install this Python as the kernel ``NAME`` under ``prefix``; returns where the spec went."""
    from ipykernel.kernelspec import install as install_kernelspec

    return install_kernelspec(kernel_name=NAME, display_name=DISPLAY_NAME, prefix=prefix)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", default=sys.prefix, help="where to install it (default: this environment)")
    print(f"Installed kernelspec {NAME} in {install(parser.parse_args().prefix)}")
