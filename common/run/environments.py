"""The environments the notebooks run in: one per framework family, each with its own Jupyter kernel.

One Python environment cannot hold every framework on a GPU box (PyPI's torch is a CUDA 13 build, TensorFlow's CUDA
packages are CUDA 12 ones that own the same files, MXNet and Chainer need numpy 1.x), so ``make setup`` builds one
per family from ``envs/<name>/`` into ``.venvs/<name>``, and a ``tools`` environment (JupyterLab, papermill, pytest,
the report) that starts every other one's kernel. Standard library only: ``envs/install.py`` reads this module before
any environment exists.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENVS = ROOT / ".venvs"
TOOLS = "tools"
STAMP = ".installed"  # in each environment: what make setup installed there, and what it took
# The oldest Linux driver each CUDA major version runs on (NVIDIA's CUDA Toolkit release notes, with minor-version
# compatibility): make setup picks the builds a driver runs, and a notebook names it when a framework cannot use a GPU.
MIN_DRIVER = {13: "580.65.06", 12: "525.60.13", 11: "450.80.02"}


@dataclass(frozen=True)
class Environment:
    name: str  # as in envs/<name>/, .venvs/<name> and make setup FRAMEWORKS="<name>"
    frameworks: str  # for people
    modules: tuple[str, ...]  # what it can import that the others cannot
    notebooks: tuple[str, ...]

    @property
    def kernel(self) -> str:
        return f"multigpu-{self.name}"

    @property
    def display_name(self) -> str:
        return f"{self.frameworks} ({self.kernel})"

    @property
    def python(self) -> Path:
        """This environment's Python as ``make setup`` builds it (whether or not it exists)."""
        return VENVS / self.name / "bin" / "python"

    @property
    def installed(self) -> bool:
        return self.python.exists()


ENVIRONMENTS = {
    env.name: env
    for env in (
        Environment(
            "pytorch",
            "PyTorch",
            ("torch", "torchvision"),
            (
                "PyTorch_MultiGPU",
                "PyTorch_MultiGPU-Exp-Loss",
                "PyTorch_ModelParallel",
                "PyTorch_Speedups",
                "DataParallel_From_Scratch",
                "PyTorch_Sharded",
            ),
        ),
        Environment(
            "tensorflow",
            "TensorFlow and Keras",
            ("tensorflow", "keras"),
            ("Tensorflow_MultiGPU", "Keras_TF_MultiGPU", "Keras_Speedups"),
        ),
        Environment(
            "mxnet-chainer",
            "MXNet and Chainer",
            ("mxnet", "chainer", "chainermn"),
            ("Gluon_MultiGPU", "Chainer_MultiGPU"),
        ),
        Environment("jax", "JAX and Flax", ("jax", "flax", "optax"), ("JAX_MultiGPU", "Keras_JAX_MultiGPU")),
    )
}


def install_record(name: str) -> dict | None:
    """What ``make setup`` recorded when it installed environment ``name``: its ``build``, ``digest``, when it
    ``started`` and the ``seconds`` it took, the ``bytes`` it holds on disk, ``date``, ``cores`` and the bytes in pip's
    cache when the set-up started (``pip_cache_bytes``); None if it is not installed."""
    try:
        return json.loads((VENVS / name / STAMP).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def for_notebook(notebook: str) -> Environment:
    """The environment whose kernel runs ``notebook`` (its name without ``.ipynb``)."""
    for env in ENVIRONMENTS.values():
        if notebook in env.notebooks:
            return env
    raise KeyError(f"{notebook} belongs to no environment: add it to common.run.environments.ENVIRONMENTS")


def for_kernel(kernel: str) -> Environment:
    return next(env for env in ENVIRONMENTS.values() if env.kernel == kernel)


def program(environment: str, name: str) -> str:
    """A program of ``environment`` as a command run from the repository names it: ``.venvs/pytorch/bin/python``."""
    return str((VENVS / environment / "bin" / name).relative_to(ROOT))


def setup_command(*names: str) -> str:
    """The command that installs these environments (and the tools)."""
    return f'make setup FRAMEWORKS="{" ".join(names)}"'
