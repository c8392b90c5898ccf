"""The MXNet Gluon notebook, executed headless with papermill on 1 and 2 simulated CPU devices."""

from notebook_harness import ResumeContract


class TestGluonNotebook(ResumeContract):
    NOTEBOOK = "Gluon_MultiGPU"
    FRAMEWORK = "mxnet"
    SUFFIX = ".gluon"
    PROGRESS = "epoch {epoch}/{epochs}"
    MULTI_MACHINE = "-p BATCH_SIZE_PER_DEVICE 16 "
    SIDE_BY_SIDE = True
    REFUSALS = {
        "unknown-kvstore": ({"KVSTORE": "dist"}, "KVSTORE must be"),
        # tests/test_multinode.py runs dist_sync on a scheduler, a server and two workers
        "dist-kvstore-without-a-cluster": ({"KVSTORE": "dist_sync"}, "parameter-server cluster"),
    }

    def test_records_name_the_kvstore(self, runs):
        assert {runs[d]["generated"]["kvstore"] for d in (1, 2)} == {"local"}
