"""Shared fixtures: small generated stand-in data sets, made once for the whole session."""

import shutil

import pytest

# torchvision 0.29.1 crashes the process when it is imported after TensorFlow 2.21: imported first, any subset
# of the test modules runs in one process, in any order.
import torchvision  # noqa: F401, I001

from common import synthetic


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
