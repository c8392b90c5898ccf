"""Which tests run where, and the shared fixtures: small generated stand-in data sets, made once per session.

``make test`` runs pytest once in each environment (``.venvs/<name>``). A framework's folder (``tests/pytorch``,
``tests/tensorflow``, ``tests/mxnet_chainer``, ``tests/jax_flax``) is collected where that framework imports; the tests
in ``tests/`` itself (framework-neutral units, and the notebooks through their kernels) where the tools are
(papermill). A test that needs an environment's kernel or Python says so with
``@pytest.mark.environments("pytorch", ...)`` and is deselected, not skipped, when ``FRAMEWORKS`` (as in
``make test FRAMEWORKS="pytorch"``) leaves that environment out.
"""

import importlib.util
import os
import shutil
from pathlib import Path

import pytest

from common.data import synthetic
from common.run.environments import ENVIRONMENTS

TESTS = Path(__file__).resolve().parent
# tests/ is on sys.path, so a folder named like a module that a framework tries to import would stand in for it where
# it is not installed: Keras tries `import jax`, and would find a folder tests/jax
FOLDER_NAMES = {"jax": "jax_flax"}
FOLDERS = {TESTS / FOLDER_NAMES.get(name, name.replace("-", "_")): env for name, env in ENVIRONMENTS.items()}


def importable(module: str) -> bool:
    """Whether ``module`` is installed here; the folder ``tests/tensorflow`` is no TensorFlow (a namespace package)."""
    spec = importlib.util.find_spec(module)
    return spec is not None and spec.origin is not None


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "environments(*names): needs these environments' kernels or Pythons (deselected without them)"
    )


def pytest_ignore_collect(collection_path, config):
    path = Path(collection_path)
    if path in FOLDERS:
        return not importable(FOLDERS[path].modules[0])
    if path.parent == TESTS and path.suffix == ".py":
        return not importable("papermill")
    return None


def selected_environments() -> set[str]:
    return set(os.environ.get("FRAMEWORKS", " ".join(ENVIRONMENTS)).split())


def pytest_collection_modifyitems(config, items):
    selected, kept, dropped = selected_environments(), [], []
    for item in items:
        needs = {name for marker in item.iter_markers("environments") for name in marker.args}
        unknown = needs - set(ENVIRONMENTS)
        assert not unknown, f"{item.nodeid}: no environment named {unknown}"
        (kept if needs <= selected else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture(scope="session")
def standin(tmp_path_factory):
    """A generated ChestX-ray14 stand-in (120 images of 32 px). Read it, never change it."""
    return synthetic.generate(tmp_path_factory.mktemp("standin") / "data", n_images=120, image_size=32, seed=0)


@pytest.fixture
def standin_copy(standin, tmp_path):
    """A private copy of the stand-in that a test may damage."""
    return shutil.copytree(standin, tmp_path / "data")


@pytest.fixture(scope="session")
def notebook_data(tmp_path_factory):
    """The stand-in every notebook test trains on: 800 images of 64 px. Read it, never change it."""
    return synthetic.generate(tmp_path_factory.mktemp("chestxray") / "data", n_images=800, image_size=64, seed=0)
