"""The PyTorch notebooks on real NVIDIA GPUs, under nbval and papermill (``tests/gpu/check.sh --tests`` runs these).

Every test here needs a GPU and skips, saying so, without one; the same notebooks run on simulated CPU devices in the
other notebook tests.
"""

import pytest
from notebook_harness import AUC_BAR, execute, marks, run_nbval

from common.measure import results
from common.run import devices, params

HARDWARE = devices.resolve(None)
pytestmark = [
    marks("PyTorch_MultiGPU", "PyTorch_MultiGPU-Exp-Loss"),
    pytest.mark.skipif(HARDWARE.kind != "gpu", reason="needs an NVIDIA GPU: NVML lists none here"),
]
# the CPU tests' tiny run, on the GPU path: bf16 autocast, cuDNN, NCCL, pinned memory, evaluation padded to full batches
TINY = dict(EPOCHS=3, IMAGE_SIZE=64, BATCH_SIZE_PER_DEVICE=16, BENCH_STEPS=5, PRECISION="mixed")


def records(folder) -> dict[str, dict]:
    return {record["data"]: record for record in results.load_all(folder / "results")}


def test_pytorch_notebook_learns_on_one_gpu_under_nbval(notebook_data, tmp_path):
    run_nbval("PyTorch_MultiGPU", notebook_data, tmp_path, DEVICES=1, **TINY)
    found = records(tmp_path)
    trained = found["generated"]
    assert trained["device_kind"] == "gpu" and trained["devices"] == 1 and trained["test_auc"] > AUC_BAR
    assert {"first steps", "train", "validate", "precise BN", "test", "teardown"} <= {
        r["phase"] for r in trained["phases"]
    }
    assert found[results.IN_RAM]["images_per_second"] > 0


def test_the_default_batch_follows_the_gpus_memory(notebook_data, tmp_path):
    execute("PyTorch_MultiGPU", notebook_data, tmp_path, DEVICES=1, EPOCHS=1, PRECISION="mixed", BENCH_STEPS=2)
    # sized from the free memory, read as the notebook reads it (nothing else should hold this GPU during the test)
    expected = params.gpu_batch_size(HARDWARE.free_gib, "mixed", params.GPU_DEFAULTS.IMAGE_SIZE)
    assert records(tmp_path)["generated"]["global_batch"] == expected


@pytest.mark.skipif(HARDWARE.count < 2, reason="needs 2 GPUs")
def test_two_gpus_reach_the_one_gpu_auc(notebook_data, tmp_path):
    one, two = tmp_path / "1", tmp_path / "2"
    for folder, count in ((one, 1), (two, 2)):
        execute("PyTorch_MultiGPU", notebook_data, folder, DEVICES=count, **TINY)
    assert abs(records(one)["generated"]["test_auc"] - records(two)["generated"]["test_auc"]) < 0.05


def test_exp_loss_measures_the_peak_memory_of_every_gpu(notebook_data, tmp_path):
    run_nbval("PyTorch_MultiGPU-Exp-Loss", notebook_data, tmp_path, DEVICES=HARDWARE.count, **TINY)
    for record in records(tmp_path).values():
        assert sorted(record["peak_memory_mib_per_device"]) == [f"cuda:{i}" for i in range(HARDWARE.count)]
        assert all(mib > 0 for mib in record["peak_memory_mib_per_device"].values())
