"""PyTorch_Speedups, executed once under nbval on 2 simulated CPU devices; then its records are checked."""

import pytest
from notebook_harness import marks, records_by_variant

from common.measure import results

pytestmark = marks("PyTorch_Speedups")

NOTEBOOK = "PyTorch_Speedups"
TINY = dict(DEVICES=2, IMAGE_SIZE=32, BATCH_SIZE_PER_DEVICE=8, BENCH_STEPS=2, MAX_IMAGES=200, BATCH_SIZES=[4, 8],
            LOADER_WORKERS=[0, 1])  # fmt: skip
# measured on a CPU: 2 loader settings and a deeper prefetch, the baseline, 2 batches, fp32 and bf16 in 2 layouts,
# eager, the plain step, two grains of checkpointing and accumulation, and 5 communication settings
RECORDS = 3 + 1 + 2 + 4 + 1 + 4 + 5


@pytest.fixture(scope="module")
def records(notebook_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("speedups")
    return records_by_variant(NOTEBOOK, notebook_data, out, RECORDS, **TINY), out


def test_every_technique_is_measured_and_recorded(records):
    found, _ = records
    techniques = {variant.split(":")[0] for variant in found}
    assert techniques == {"input pipeline", "baseline", "batch size", "precision", "compiler", "memory",
                          "communication"}  # fmt: skip
    for record in found.values():
        assert record["data"] == results.IN_RAM and record["images_per_second"] > 0 and record["notebook"] == NOTEBOOK
    assert found["communication: DDP"]["devices"] == 2 and found["communication: DDP"]["global_batch"] == 16


def test_what_needs_a_gpu_is_named_not_measured(records):
    why = next(iter(records[0].values()))["not_measured"]
    assert why["precision: fp16 + loss scaling, NCHW"] == "fp16 autocast needs a GPU"
    assert "cuDNN" in why["cuDNN autotuning: on and off"] and "minutes on a CPU" in why["compiler: torch.compile"]


def test_the_tricks_that_change_the_arithmetic_compute_the_plain_step(records):
    checks = next(iter(records[0].values()))["checks"]
    assert all(row["largest difference"] < 1e-5 for row in checks.values()), checks


def test_the_profiler_trace_is_written_next_to_the_results(records):
    (trace,) = (records[1] / "results" / "traces").glob("speedups-cpu-*.json")
    assert trace.stat().st_size > 0
