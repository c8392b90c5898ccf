"""The TensorFlow custom-loop notebook, executed headless with papermill on 1 and 2 simulated CPU devices."""

from notebook_harness import ResumeContract, assert_stops_before_training


class TestTensorflowNotebook(ResumeContract):
    NOTEBOOK = "Tensorflow_MultiGPU"
    FRAMEWORK = "tensorflow"
    SUFFIX = ".tf"
    PROGRESS = "epoch {epoch}/{epochs}"
    MULTI_MACHINE = "-p BATCH_SIZE_PER_DEVICE 16 "
    SIDE_BY_SIDE = True

    def test_records_name_the_strategy(self, runs):
        assert {runs[d]["generated"]["strategy"] for d in (1, 2)} == {"mirrored"}

    def test_unknown_strategy_stops_before_training(self, notebook_data, tmp_path):
        assert_stops_before_training(self.NOTEBOOK, notebook_data, tmp_path, {"STRATEGY": "central"}, "STRATEGY")

    def test_multi_worker_on_two_cpu_devices_asks_for_workers(self, notebook_data, tmp_path):
        parameters = {"STRATEGY": "multi_worker", "DEVICES": 2}
        assert_stops_before_training(self.NOTEBOOK, notebook_data, tmp_path, parameters, "TF_CONFIG")
