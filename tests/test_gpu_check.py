"""tests/gpu/check.sh plans its run from the GPUs it finds (a faked nvidia-smi): data sized so that every GPU count
takes several steps, the notebooks that can run there, each with its own time cap."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.run import params

CHECK = Path(__file__).parent / "gpu" / "check.sh"


def plan(tmp_path, gpus: int, capability: str) -> str:
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = -L ]; then for i in $(seq 0 {gpus - 1}); do echo "GPU $i: NVIDIA H100 (UUID: GPU-$i)"; done\n'
        f"else for i in $(seq 1 {gpus}); do echo {capability}; done; fi\n"
    )
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("CHECK_NOTEBOOK_SECONDS", None)
    out = subprocess.run(["bash", str(CHECK), "--plan"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.mark.parametrize("gpus", [1, 8])
def test_the_gpu_check_sizes_its_data_from_the_gpu_count_and_caps_each_notebook(tmp_path, gpus):
    images = max(1200, params.images_for_steps(4, 64 * gpus))
    printed = plan(tmp_path, gpus, "9.0")
    assert f"{gpus} GPU(s): {images} generated images, 64 per GPU" in printed
    assert "PyTorch_MultiGPU PyTorch_MultiGPU-Exp-Loss" in printed and "each within 150 s" in printed


@pytest.mark.parametrize(("capability", "gluon"), [("8.0", True), ("9.0", False)])
def test_the_gpu_check_runs_gluon_only_where_mxnet_has_kernels(tmp_path, capability, gluon):
    printed = plan(tmp_path, 2, capability)
    assert ("Gluon_MultiGPU, each within" in printed) is gluon
    assert ("Gluon_MultiGPU: skipped, MXNet has no kernels for compute capability 9.0" in printed) is not gluon
