"""The JAX notebook, executed headless with papermill on 1 and 2 simulated CPU devices.

Its sharded mode (PARALLELISM="fsdp") is the same step with the state placed by ``common.jax.utils.fsdp_spec``:
tests/jax_flax checks the bytes per device of DenseNet-121's state under that rule, and that a step with sharded
state equals the replicated one, without a third notebook run's compiling."""

import pytest
from notebook_harness import ResumeContract

from common.run import protocol


class TestJaxNotebook(ResumeContract):
    NOTEBOOK = "JAX_MultiGPU"
    FRAMEWORK = "jax"
    SUFFIX = ".orbax"
    PROGRESS = "epoch {epoch}/{epochs}"
    MULTI_MACHINE = None  # one process drives every device; jax.distributed across machines is not built yet
    SIDE_BY_SIDE = True  # XLA compiles on one thread: the two runs overlap their compiling
    REFUSALS = {
        "unknown-parallelism": ({"PARALLELISM": "zero"}, "PARALLELISM"),
        "pretrained": ({"PRETRAINED": True}, "ImageNet"),
    }

    def test_records_name_the_parallelism_and_the_state_each_device_holds(self, runs):
        trained = [runs[devices]["generated"] for devices in (1, 2)]
        assert {record["parallelism"] for record in trained} == {"data"}
        # replicated: every device holds all of DenseNet-121's weights, statistics and Adam's two moments
        assert trained[0]["state_mib_per_device"] == trained[1]["state_mib_per_device"] == pytest.approx(80.1, abs=0.1)

    def test_the_written_out_all_reduce_gives_the_partitioners_step(self, runs, run_dir):
        check = protocol.read_glued(run_dir / "2" / "executed-2.ipynb")["all_reduce_check"]
        # two devices, replicated: the two programs agree far closer than the notebook's bar (1e-7 of the largest
        # gradient, measured); a step without the all-reduce is off by a large share of it
        assert set(check) == {"gradients", "statistics", "loss"} and max(check.values()) < 1e-5, check
