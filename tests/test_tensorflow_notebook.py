"""The TensorFlow custom-loop notebook, executed headless with papermill on 1 and 2 simulated CPU devices."""

from notebook_harness import ResumeContract


class TestTensorflowNotebook(ResumeContract):
    NOTEBOOK = "Tensorflow_MultiGPU"
    FRAMEWORK = "tensorflow"
    SUFFIX = ".tf"
    PROGRESS = "epoch {epoch}/{epochs}"
    MULTI_MACHINE = "-p BATCH_SIZE_PER_DEVICE 16 "
    SIDE_BY_SIDE = True
    REFUSALS = {
        "unknown-strategy": ({"STRATEGY": "central"}, "STRATEGY"),
        "multi-worker-without-workers": ({"STRATEGY": "multi_worker", "DEVICES": 2}, "TF_CONFIG"),
    }

    def test_records_name_the_strategy(self, runs):
        assert {runs[d]["generated"]["strategy"] for d in (1, 2)} == {"mirrored"}
