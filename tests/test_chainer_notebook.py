"""The Chainer (ChainerMN) notebook, executed headless with papermill on 1 and 2 simulated CPU devices (MPI ranks)."""

from notebook_harness import ResumeContract


class TestChainerNotebook(ResumeContract):
    NOTEBOOK = "Chainer_MultiGPU"
    FRAMEWORK = "chainer"
    SUFFIX = ".chainer"
    PROGRESS = "epoch {epoch}: "  # printed by rank 0 after each epoch
    MULTI_MACHINE = "config-2-nodes.json"
    # one process leaves a core idle, two MPI ranks use both: an epoch takes 27 s on 2 ranks against 49 s on 1
    CHECKPOINTS = 2
    # Chainer has no ImageNet DenseNet-121 weights: the notebook says so instead of training from scratch
    REFUSALS = {"pretrained": ({"PRETRAINED": True}, "PRETRAINED=True")}

    def test_cpu_runs_are_recorded_as_fp32_over_the_naive_communicator(self, runs):
        for devices in (1, 2):
            record = runs[devices]["generated"]
            assert record["precision"] == "fp32" and record["requested_precision"] == "fp32"
            assert record["communicator"] == "naive" and record["versions"]["chainer"] == "7.8.1"
