"""The JAX notebook, executed headless with papermill on 1 and 2 simulated CPU devices, data parallel and sharded."""

import concurrent.futures

import pytest
from notebook_harness import ResumeContract, assert_stops_before_training, execute, records_by_devices

from common.measure import results
from common.run import protocol


class TestJaxNotebook(ResumeContract):
    NOTEBOOK = "JAX_MultiGPU"
    FRAMEWORK = "jax"
    SUFFIX = ".orbax"
    PROGRESS = "epoch {epoch}/{epochs}"
    MULTI_MACHINE = None  # one process drives every device; jax.distributed across machines is not built yet
    SIDE_BY_SIDE = True  # XLA compiles on one thread: the two runs overlap their compiling

    @pytest.fixture(scope="class")
    @classmethod
    def runs(cls, notebook_data, run_dir):
        """The 1- and 2-device runs, and beside them a sharded one on 2 devices: the three spend most of their time
        compiling, each on one thread."""
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            sharded = pool.submit(execute, cls.NOTEBOOK, notebook_data, run_dir / "fsdp", DEVICES=2,
                                  PARALLELISM="fsdp", **cls.TINY)  # fmt: skip
            found = records_by_devices(cls.NOTEBOOK, notebook_data, run_dir, True, cls.CHECKPOINTS, **cls.TINY)
            sharded.result()
        return found

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

    def test_sharded_state_is_split_across_the_devices_and_trains_alike(self, runs, run_dir):
        sharded = {record["data"]: record for record in results.load_all(run_dir / "fsdp" / "results")}["generated"]
        replicated = runs[2]["generated"]
        # every array of the state has an axis that 2 divides: each device holds exactly half
        assert sharded["state_mib_per_device"] == pytest.approx(replicated["state_mib_per_device"] / 2, abs=0.1)
        assert sharded["parallelism"] == "fsdp"
        # the same computation, its sums taken in another order
        assert sharded["train_loss"] == pytest.approx(replicated["train_loss"], rel=0.02)
        assert abs(sharded["test_auc"] - replicated["test_auc"]) < 0.02
        # the gathers and reduce-scatters take the sums in yet another order: 1e-3 of the largest gradient, measured
        check = protocol.read_glued(run_dir / "fsdp" / "executed-2.ipynb")["all_reduce_check"]
        assert max(check.values()) < 1e-2, check

    def test_unknown_parallelism_stops_before_training(self, notebook_data, tmp_path):
        assert_stops_before_training(self.NOTEBOOK, notebook_data, tmp_path, {"PARALLELISM": "zero"}, "PARALLELISM")

    def test_pretrained_is_refused(self, notebook_data, tmp_path):
        assert_stops_before_training(self.NOTEBOOK, notebook_data, tmp_path, {"PRETRAINED": True}, "ImageNet")
