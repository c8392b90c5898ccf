"""Checkpoint and resume: a training run killed with SIGKILL mid-epoch continues where its last checkpoint left it."""

import pytest
from notebook_harness import assert_stops_before_training, execute, marks, printed
from resume_harness import run_until_killed

from common.measure import results
from common.run import checkpoints

# two epochs: the run is killed in the second, and the resumed run trains only that one
TINY = dict(EPOCHS=2, IMAGE_SIZE=64, BATCH_SIZE_PER_DEVICE=16, BENCH_STEPS=2)
# notebook: (devices, the file a checkpoint's state is saved as, the progress line of a trained epoch). The kill is
# the point here: a checkpoint survives it whichever notebook saved it (common.run.checkpoints.save writes, then
# renames), and every other notebook that checkpoints resumes in its own tests (notebook_harness.ResumeContract).
NOTEBOOKS = {
    "PyTorch_MultiGPU": (2, "epoch-0001.pt", "epoch {}/2"),
}


@pytest.mark.parametrize("name", [pytest.param(name, marks=marks(name)) for name in NOTEBOOKS])
def test_resumes_after_sigkill_in_the_middle_of_epoch_2(name, notebook_data, tmp_path):
    devices, state, progress = NOTEBOOKS[name]
    saved, parameters = tmp_path / "checkpoints", {**TINY, "DEVICES": devices}
    # an epoch takes 10 s or more on 2 cores: killed 3 s after epoch 1's checkpoint, epoch 2 is under way
    run_until_killed(name, notebook_data, tmp_path, saved, epoch=1, delay=3, timeout=400, **parameters)
    survived = checkpoints.complete(saved)
    assert [checkpoint.epoch for checkpoint in survived] == [1] and survived[0].state.name == state
    assert not list((tmp_path / "results").glob("*.json")), "a killed run wrote a results record"

    executed = execute(name, notebook_data, tmp_path, CHECKPOINT_DIR=str(saved), RESUME=True, **parameters)
    records = {record["data"]: record for record in results.load_all(tmp_path / "results")}
    assert set(records) == {"generated", results.IN_RAM} and len(list((tmp_path / "results").glob("*.json"))) == 2
    trained = records["generated"]
    assert len(trained["epoch_seconds"]) == len(trained["valid_auc"]) == TINY["EPOCHS"]
    # epoch 1 comes from the checkpoint, not from training it again
    assert trained["epoch_seconds"][0] == survived[0].history["epoch_seconds"][0]
    assert [checkpoint.epoch for checkpoint in checkpoints.complete(saved)] == [1, 2]
    log = printed(executed)
    assert "Resuming after epoch 1" in log and progress.format(1) not in log and progress.format(2) in log


@marks("PyTorch_MultiGPU")
def test_a_checkpoint_folder_of_another_run_is_refused_before_training(notebook_data, tmp_path):
    """The refusal is common.run.checkpoints.start's, unit-tested there; this shows a notebook asks it before
    training."""
    saved = tmp_path / "checkpoints"
    saved.mkdir()
    checkpoints.save(saved, 1, ".pt", lambda path: path.write_bytes(b"state"), {"DEVICES": 1}, {})
    assert_stops_before_training(
        "PyTorch_MultiGPU",
        notebook_data,
        tmp_path / "fresh",
        {"CHECKPOINT_DIR": str(saved)},
        "set RESUME=True to continue that run",
    )
