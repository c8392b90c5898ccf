"""Checkpoint and resume: a training run killed with SIGKILL mid-epoch continues where its last checkpoint left it."""

import nbformat
from notebook_harness import AUC_BAR, assert_stops_before_training, execute
from resume_harness import run_until_killed

from common import checkpoints, results

TINY = dict(DEVICES=2, EPOCHS=3, IMAGE_SIZE=64, BATCH_SIZE_PER_DEVICE=16, BENCH_STEPS=2)


def test_pytorch_resumes_after_sigkill_in_the_middle_of_epoch_2(notebook_data, tmp_path):
    saved = tmp_path / "checkpoints"
    # epoch 2 takes about 10 s on 2 cores: killed 3 s after epoch 1's checkpoint, it is half done
    run_until_killed("PyTorch_MultiGPU", notebook_data, tmp_path, saved, epoch=1, delay=3, timeout=300, **TINY)
    survived = checkpoints.complete(saved)
    assert [checkpoint.epoch for checkpoint in survived] == [1]
    assert not list((tmp_path / "results").glob("*.json")), "a killed run wrote a results record"

    executed = execute("PyTorch_MultiGPU", notebook_data, tmp_path, CHECKPOINT_DIR=str(saved), RESUME=True, **TINY)
    records = {record["data"]: record for record in results.load_all(tmp_path / "results")}
    assert set(records) == {"generated", results.IN_RAM} and len(list((tmp_path / "results").glob("*.json"))) == 2
    trained = records["generated"]
    assert len(trained["epoch_seconds"]) == len(trained["valid_auc"]) == TINY["EPOCHS"]
    # epoch 1 comes from the checkpoint, not from training it again
    assert trained["epoch_seconds"][0] == survived[0].history["epoch_seconds"][0]
    assert trained["test_auc"] > AUC_BAR
    assert [checkpoint.epoch for checkpoint in checkpoints.complete(saved)] == [2, 3]
    log = "".join(
        output.get("text", "")
        for cell in nbformat.read(executed, as_version=4).cells
        for output in cell.get("outputs", [])
    )
    assert "Resuming after epoch 1" in log and "epoch 1/3" not in log and "epoch 2/3" in log


def test_pytorch_refuses_a_checkpoint_folder_of_another_run_before_training(notebook_data, tmp_path):
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


def test_keras_resumes_after_sigkill_in_the_middle_of_epoch_2(notebook_data, tmp_path):
    saved, parameters = tmp_path / "checkpoints", {**TINY, "DEVICES": 1}  # one replica: half the tracing time
    # an epoch takes 15 s or more on one core: killed 3 s after epoch 1's checkpoint, epoch 2 is under way
    run_until_killed("Keras_TF_MultiGPU", notebook_data, tmp_path, saved, epoch=1, delay=3, timeout=400, **parameters)
    survived = checkpoints.complete(saved)
    assert [checkpoint.epoch for checkpoint in survived] == [1] and survived[0].state.name == "epoch-0001.weights.h5"
    assert not list((tmp_path / "results").glob("*.json")), "a killed run wrote a results record"

    executed = execute(
        "Keras_TF_MultiGPU", notebook_data, tmp_path, CHECKPOINT_DIR=str(saved), RESUME=True, **parameters
    )
    records = {record["data"]: record for record in results.load_all(tmp_path / "results")}
    assert set(records) == {"generated", results.IN_RAM} and len(list((tmp_path / "results").glob("*.json"))) == 2
    trained = records["generated"]
    assert len(trained["epoch_seconds"]) == len(trained["valid_auc"]) == TINY["EPOCHS"]
    assert trained["epoch_seconds"][0] == survived[0].history["epoch_seconds"][0]
    assert [checkpoint.epoch for checkpoint in checkpoints.complete(saved)] == [2, 3]
    log = "".join(
        output.get("text", "")
        for cell in nbformat.read(executed, as_version=4).cells
        for output in cell.get("outputs", [])
    )
    assert "Resuming after epoch 1" in log and "Epoch 1/3" not in log and "Epoch 2/3" in log
