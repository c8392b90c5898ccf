"""The Docker images and the GPU check script, checked without a Docker engine or a GPU."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
DOCKERFILES = {"cpu": ROOT / "docker" / "Dockerfile.cpu", "gpu": ROOT / "docker" / "Dockerfile.gpu"}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [tuple(line.split(None, 1)) for line in lines]


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_every_copied_path_exists_and_is_not_ignored(kind):
    ignored = [line.rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines() if line[:1].isalnum()]
    copies = [args.split() for op, args in instructions(DOCKERFILES[kind]) if op == "COPY"]
    assert copies
    for *sources, _ in copies:
        for source in sources:
            assert (ROOT / source).exists(), f"{kind} image copies {source}, which does not exist"
            assert source.rstrip("/") not in ignored, f"{kind} image copies {source}, which .dockerignore leaves out"


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_installs_through_make_setup_only(kind):
    """The pins come from the locks in envs/ through `make setup`: no pip install of its own in the image."""
    runs = " ".join(args for op, args in instructions(DOCKERFILES[kind]) if op == "RUN")
    assert "pip install" not in runs and "pip3 install" not in runs
    assert f"make setup GPU={1 if kind == 'gpu' else 0} PYTHON=python3.11" in runs
    copied = " ".join(args for op, args in instructions(DOCKERFILES[kind]) if op == "COPY")
    for needed in ("envs/", "common/", "Makefile", "pyproject.toml"):
        assert needed in copied


def test_both_images_have_python_3_11_and_the_gpu_image_no_cuda_toolkit_of_its_own():
    """Every CUDA library comes from pip, per environment: a CUDA base image would add a second, unused stack."""
    for kind in DOCKERFILES:
        assert next(args for op, args in instructions(DOCKERFILES[kind]) if op == "FROM").startswith("python:3.11")
    gpu = DOCKERFILES["gpu"].read_text()
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in gpu and 'DRIVER="$DRIVER"' in gpu


def test_gpu_check_script_skips_with_a_message_without_a_gpu():
    script = ROOT / "tests" / "gpu" / "check.sh"
    if subprocess.run("nvidia-smi -L 2>/dev/null | grep -q '^GPU'", shell=True).returncode == 0:
        pytest.skip("a GPU is present: tests/gpu/check.sh runs for real there, not in the test suite")
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "skipped, no NVIDIA GPU" in out.stdout, out.stdout + out.stderr
    header = script.read_text().split("set -euo pipefail")[0]
    assert "What it checks" in header and "its own time cap (CHECK_NOTEBOOK_SECONDS" in header
