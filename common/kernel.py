"""The Jupyter kernel every notebook runs on: its name, defined here once, and its installation.

python -m common.kernel                  # into this environment (``make setup`` does this)
python -m common.kernel --prefix /tmp/j  # elsewhere; then JUPYTER_PATH=/tmp/j/share/jupyter finds it
"""

from __future__ import annotations

import argparse
import sys

NAME = "multigpu-notebooks"
DISPLAY_NAME = f"Python 3 ({NAME})"


def install(prefix: str = sys.prefix) -> str:
    """Install this Python as the kernel ``NAME`` under ``prefix``; returns where the spec went."""
    from ipykernel.kernelspec import install as install_kernelspec

    return install_kernelspec(kernel_name=NAME, display_name=DISPLAY_NAME, prefix=prefix)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", default=sys.prefix, help="where to install it (default: this environment)")
    print(f"Installed kernelspec {NAME} in {install(parser.parse_args().prefix)}")
