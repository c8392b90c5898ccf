"""The Keras notebook on the JAX backend, executed headless with papermill on 1 and 2 simulated CPU devices."""

from notebook_harness import ResumeContract
from test_keras_notebook import KERAS_AUC_TOLERANCE


class TestKerasJaxNotebook(ResumeContract):
    NOTEBOOK = "Keras_JAX_MultiGPU"
    FRAMEWORK = "keras"
    SUFFIX = ".weights.h5"
    PROGRESS = "Epoch {epoch}/{epochs}"
    MULTI_MACHINE = None  # one process drives every device; keras.distribution across machines is not built
    SIDE_BY_SIDE = True  # XLA compiles on one thread: the two runs overlap their compiling

    def test_keras_auc_agrees_with_the_exact_auc(self, runs):
        """Also that the padding of the last evaluation batch is left out: weighted 0 in Keras' AUC, its scores
        dropped from the exact one."""
        for devices in (1, 2):
            record = runs[devices]["generated"]
            assert abs(record["keras_test_auc"] - record["test_auc"]) < KERAS_AUC_TOLERANCE, devices

    def test_records_name_the_backend(self, runs):
        assert {runs[devices]["generated"]["backend"] for devices in (1, 2)} == {"jax"}
