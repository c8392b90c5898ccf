"""DataParallel_From_Scratch on 1 (under nbval) and 2 simulated CPU devices, then one of its exercises' mistakes."""

import pytest
from notebook_harness import NotebookContract, execute

from common.measure import results
from common.teach import exercises

NOTEBOOK = "DataParallel_From_Scratch"


class TestFromScratchNotebook(NotebookContract):
    NOTEBOOK = NOTEBOOK
    FRAMEWORK = "pytorch"
    MULTI_MACHINE = "config-2-nodes.json"
    REFUSALS = {
        "unknown-exercise-value": ({"GRADIENTS": "mean"}, "must be one of"),
        "pretrained": ({"PRETRAINED": True}, "has no pretrained weights"),
    }

    def test_each_way_of_stepping_is_checked_against_one_process(self, runs):
        check = runs[2]["generated"]["check"]
        rounding = 1e-3 * check["step_size"]
        assert check["step_size"] > 1e-4, "the step moved the weights: equal weights after it are not trivial"
        assert check["by_hand_vs_one_process"] <= rounding and check["ddp_vs_by_hand"] <= rounding
        assert check["global_batch_norm_vs_one_process"] <= rounding
        # BatchNorm per share is not one device: the difference is of the order of the step itself
        assert check["local_batch_norm_vs_one_process"] > 0.1 * check["step_size"]
        assert check["ddp_buffers_apart_before_forward"] == 0 < check["ddp_buffers_apart_after_step"]
        assert check["bucket_bytes"] == [check["gradient_bytes"]], "a small model's gradients fill one bucket"
        one = runs[1]["generated"]["check"]  # one process: nothing to exchange, every way is the one process
        assert one["local_batch_norm_vs_one_process"] <= 1e-3 * one["step_size"]

    @pytest.mark.parametrize("devices", [1, 2])
    def test_the_copies_stay_in_step_and_every_epoch_is_shuffled_anew(self, runs, devices):
        trained = runs[devices]["generated"]
        assert trained["replicas_apart"] == 0 and trained["repeated_orders"] == 0
        assert len(trained["rank_test_auc"]) == devices and len(set(trained["rank_test_auc"])) == 1
        assert runs[devices][results.IN_RAM]["ddp_images_per_second"] > 0

    def test_an_exercise_mistake_trains_and_its_answer_shows_the_copies_apart(self, runs, run_dir, notebook_data):
        """GRADIENTS="local" (no all-reduce) runs to the end; the exercise's answer compares it with the default run."""
        out = run_dir / "2"
        execute(NOTEBOOK, notebook_data, out, output=out / "local.ipynb", GRADIENTS="local", DEVICES=2, **self.TINY)
        table = exercises.compare(
            out / "results", NOTEBOOK, GRADIENTS=["average", "local"], fields=("replicas_apart", "rank_test_auc")
        )
        assert list(table.index) == ["average", "local"]
        assert table.loc["average", "replicas_apart"] == 0 < table.loc["local", "replicas_apart"]
        assert len(set(table.loc["local", "rank_test_auc"])) == 2, "each copy trained on its own share: two AUCs"
