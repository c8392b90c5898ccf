"""common.run.protocol: one config in, one result out, and the ranks' reports, the same for every launched script."""

import json
import shlex

import nbformat
import numpy as np
import pytest
from papermill.cli import _resolve_type

from common.errors import InputError
from common.run import devices, params, protocol
from common.run.checkpoints import Checkpoint
from common.run.launch import WORKER_PARAMETERS, papermill_parameters


def launch(tmp_path, **extra):
    cfg = params.fill("cpu", EPOCHS=2)
    hardware = devices.resolve(2, gpus=[], cores=4)
    return protocol.launch_config(
        tmp_path,
        tmp_path / "data",
        cfg,
        hardware,
        global_batch=32,
        learning_rate=2e-3,
        precision="fp32",
        seed=0,
        **extra,
    )


def test_a_launch_config_round_trips_with_the_resolved_settings(tmp_path):
    resume = Checkpoint(1, tmp_path / "epoch-0001.pt", {}, {})
    config = protocol.read_config(launch(tmp_path, resume_from=resume, micro_batches=[1, 2]))
    assert config.epochs == 2 and config.batch_size_per_device == params.CPU_DEFAULTS.BATCH_SIZE_PER_DEVICE
    assert (config.devices, config.device_kind, config.global_batch, config.learning_rate) == (2, "cpu", 32, 2e-3)
    assert config.loader_workers == devices.loader_workers("cpu", 2) == 1
    assert config.resume_from == str(tmp_path / "epoch-0001.pt") and config.checkpoint_dir is None
    assert config.extra == {"micro_batches": [1, 2]}  # a script's own settings, apart from the shared schema


def test_a_run_on_two_machines_gets_the_global_batch_and_learning_rate_of_all_its_processes(tmp_path):
    one_machine = launch(tmp_path)  # 2 processes of 16 images: a global batch of 32 at 2e-3
    config = protocol.read_config(one_machine)
    protocol.check_world(config, 2)
    with pytest.raises(InputError, match="4 processes joined, making a global batch of 64"):
        protocol.check_world(config, 4)  # the one-machine config on two machines: twice the batch, the same rate
    whole = protocol.read_config(protocol.multinode_config(one_machine, nodes=2))
    assert (whole.global_batch, whole.learning_rate) == (64, pytest.approx(2e-3 * 2**0.5))  # Adam's square-root rule
    protocol.check_world(whole, 4)
    assert protocol.read_config(one_machine) == config, "the one-machine config stays as it was"


def test_a_config_with_an_unknown_key_is_refused(tmp_path):
    path = launch(tmp_path)
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "GLOBAL_BATCH": 32}))  # the old, per-notebook spelling
    with pytest.raises(TypeError, match="GLOBAL_BATCH"):
        protocol.read_config(path)


def test_a_result_comes_back_with_its_predictions_and_no_temporary_files(tmp_path):
    labels, scores = np.eye(3, 14), np.full((3, 14), 0.5)
    history = protocol.new_history(train_images=10, images_per_epoch=8)
    protocol.write_result(tmp_path, "train", (labels, scores), history=history, ranks=[])
    found = protocol.read_result(tmp_path, "train")
    assert found["history"] == history and found["ranks"] == []
    np.testing.assert_array_equal(found["labels"], labels)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["train.json", "train.npz"]
    protocol.write_result(tmp_path, "benchmark", images_per_second=np.float32(12.5))
    assert protocol.read_result(tmp_path, "benchmark") == {"images_per_second": 12.5}


def test_the_fingerprint_depends_on_names_values_and_order():
    a, b = np.zeros(3), np.ones(3)
    assert protocol.fingerprint([("a", a), ("b", b)]) == protocol.fingerprint([("a", a.copy()), ("b", b.copy())])
    assert protocol.fingerprint([("a", a), ("b", b)]) != protocol.fingerprint([("a", b), ("b", a)])
    assert protocol.fingerprint([("a", a)]) != protocol.fingerprint([("x", a)])


def test_ranks_in_step_share_one_fingerprint_and_drift_is_refused(capsys):
    reports = [protocol.rank_report(rank, "f" * 64, 0.25, 0.8) for rank in (0, 1)]
    assert "rank 1: weights sha256 ffff" in capsys.readouterr().out
    assert protocol.check_in_step(reports) == "f" * 64
    with pytest.raises(RuntimeError, match="rank 1: eeeeeeeeeeee"):
        protocol.check_in_step([reports[0], {**reports[1], "weights_sha256": "e" * 64}])


def test_glued_values_are_read_back_from_an_executed_notebook(tmp_path):
    notebook = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("")
    cell.outputs = [
        nbformat.v4.new_output("stream", text="rank 0: ..."),
        nbformat.v4.new_output(
            "display_data", data={protocol.GLUE_MIME: {"name": "rank_report", "value": {"rank": 0}}}
        ),
    ]
    notebook.cells.append(cell)
    nbformat.write(notebook, tmp_path / "done.ipynb")
    assert protocol.read_glued(tmp_path / "done.ipynb") == {"rank_report": {"rank": 0}}


def test_workers_started_by_hand_get_every_parameter_that_shapes_the_run():
    """A multi-machine TensorFlow or Gluon worker runs the notebook itself: with its own machine's defaults it would
    train another run (another batch, precision, subset) than the one its commands were printed for."""
    cfg = params.fill("cpu", EPOCHS=2, BATCH_SIZE_PER_DEVICE=16, IMAGE_SIZE=None, MAX_IMAGES=None, PRECISION="mixed")
    text = papermill_parameters(cfg, PRETRAINED=False, PREPARED=True, SEED=3, DEVICES=1, DATA_DIR="/my data")
    words = shlex.split(text)
    sent = {name: _resolve_type(value) for flag, name, value in zip(words[::3], words[1::3], words[2::3], strict=True)}
    assert set(words[::3]) == {"-p"} and set(WORKER_PARAMETERS) <= set(sent)
    assert sent == {"EPOCHS": 2, "BATCH_SIZE_PER_DEVICE": 16, "IMAGE_SIZE": 64, "MAX_IMAGES": 800, "PRECISION": "mixed",
                    "PRETRAINED": False, "PREPARED": True, "SEED": 3, "DEVICES": 1, "DATA_DIR": "/my data"}  # fmt: skip
