"""The Jupyter kernels the notebooks run on, one per environment (:mod:`common.run.environments`): their
installation, and what a worker does when its cell is interrupted.

python -m common.run.kernel --environment pytorch                 # this Python as multigpu-pytorch, into the tools
python -m common.run.kernel --environment pytorch --prefix /tmp/j  # elsewhere; JUPYTER_PATH=/tmp/j/share/jupyter
python -m common.run.kernel --environment pytorch --user           # for a JupyterLab of your own

``make setup`` installs each environment's kernel into the tools environment, whose JupyterLab and papermill then find
every one of them.
"""

from __future__ import annotations

import argparse
import sys

from common.run.environments import ENVIRONMENTS, TOOLS, VENVS


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


def install(environment: str, prefix: str | None = None, user: bool = False) -> str:
    """Install this Python as ``environment``'s kernel under ``prefix`` (or for this user); returns where it went."""
    from ipykernel.kernelspec import install as install_kernelspec

    env = ENVIRONMENTS[environment]
    return install_kernelspec(kernel_name=env.kernel, display_name=env.display_name, prefix=prefix, user=user)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--environment", required=True, choices=ENVIRONMENTS, help="the environment this Python is")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--prefix", help=f"where to install it (default: {VENVS / TOOLS}, else this environment)")
    where.add_argument("--user", action="store_true", help="into this user's Jupyter folder")
    args = parser.parse_args()
    prefix = None if args.user else args.prefix or str(VENVS / TOOLS if (VENVS / TOOLS).is_dir() else sys.prefix)
    where = install(args.environment, prefix, args.user)
    print(f"Installed kernelspec {ENVIRONMENTS[args.environment].kernel} in {where}")
