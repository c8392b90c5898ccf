"""The MXNet Gluon notebook, executed headless with papermill on 1 and 2 simulated CPU devices."""

from notebook_harness import ResumeContract, assert_stops_before_training


class TestGluonNotebook(ResumeContract):
    NOTEBOOK = "Gluon_MultiGPU"
    FRAMEWORK = "mxnet"
    SUFFIX = ".gluon"
    PROGRESS = "epoch {epoch}/{epochs}"
    MULTI_MACHINE = "-p BATCH_SIZE_PER_DEVICE 16 "
    SIDE_BY_SIDE = True

    def test_records_name_the_kvstore(self, runs):
        assert {runs[d]["generated"]["kvstore"] for d in (1, 2)} == {"local"}

    def test_unknown_kvstore_is_refused(self, notebook_data, tmp_path):
        assert_stops_before_training(self.NOTEBOOK, notebook_data, tmp_path, {"KVSTORE": "dist"}, "KVSTORE must be")

    def test_dist_kvstore_without_a_cluster_is_refused(self, notebook_data, tmp_path):
        # tests/test_multinode.py runs dist_sync on a scheduler, a server and two workers
        parameters = {"KVSTORE": "dist_sync"}
        assert_stops_before_training(self.NOTEBOOK, notebook_data, tmp_path, parameters, "parameter-server cluster")
