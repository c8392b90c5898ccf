"""Per-epoch checkpoints: complete or absent, the newest kept, and RESUME refused where it would mislead."""

import json

import pytest

from common.errors import InputError
from common.run import checkpoints

SETTINGS = {"EPOCHS": 3, "DEVICES": 2, "IMAGE_SIZE": (64, 64)}


def save(folder, epoch, settings=SETTINGS):
    return checkpoints.save(
        folder,
        epoch,
        ".pt",
        lambda path: path.write_bytes(b"state %d" % epoch),
        settings,
        {"epoch_seconds": [1.0] * epoch},
    )


def test_save_writes_state_then_metadata_and_keeps_the_newest_two(tmp_path):
    for epoch in (1, 2, 3):
        save(tmp_path, epoch)
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "epoch-0002.json",
        "epoch-0002.pt",
        "epoch-0003.json",
        "epoch-0003.pt",
    ]
    newest = checkpoints.complete(tmp_path)[-1]
    assert newest.epoch == 3 and newest.state.read_bytes() == b"state 3"
    assert newest.history == {"epoch_seconds": [1.0, 1.0, 1.0]}


def test_a_checkpoint_without_its_state_or_with_a_half_written_file_does_not_count(tmp_path):
    save(tmp_path, 1)
    save(tmp_path, 2)
    (tmp_path / "epoch-0002.pt").unlink()  # as if the state had been lost
    (tmp_path / ".epoch-0003.pt-x1y2").write_bytes(b"half")  # a write killed before its rename
    assert [checkpoint.epoch for checkpoint in checkpoints.complete(tmp_path)] == [1]


def test_a_failing_state_writer_leaves_no_checkpoint_behind(tmp_path):
    def crash(path):
        path.write_bytes(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        checkpoints.save(tmp_path, 1, ".pt", crash, SETTINGS, {})
    assert list(tmp_path.iterdir()) == []


def test_start_resumes_from_the_newest_with_the_same_settings(tmp_path, capsys):
    save(tmp_path, 1)
    save(tmp_path, 2)
    (tmp_path / ".epoch-0003.pt-x1y2").write_bytes(b"half")  # a write killed before its rename
    found = checkpoints.start(tmp_path, True, dict(SETTINGS))
    assert found.epoch == 2 and found.state.name == "epoch-0002.pt"
    assert not (tmp_path / ".epoch-0003.pt-x1y2").exists()
    assert "Resuming after epoch 2" in capsys.readouterr().out


def test_start_fresh_without_checkpoints_or_without_a_folder(tmp_path, capsys):
    assert checkpoints.start(None, False, SETTINGS) is None
    assert checkpoints.start(tmp_path / "new", True, SETTINGS) is None
    assert "starts at epoch 1" in capsys.readouterr().out
    assert (tmp_path / "new").is_dir()


@pytest.mark.parametrize(
    ("folder", "resume", "settings", "message"),
    [
        (None, True, SETTINGS, "RESUME=True needs CHECKPOINT_DIR"),
        ("run", False, SETTINGS, "set RESUME=True to continue that run, or choose an empty folder"),
        ("run", True, {**SETTINGS, "DEVICES": 1}, "DEVICES was 2, now 1"),
    ],
    ids=["resume-without-folder", "folder-of-another-run", "other-settings"],
)
def test_start_refuses_what_would_mislead(tmp_path, folder, resume, settings, message):
    (tmp_path / "run").mkdir()
    save(tmp_path / "run", 1)
    with pytest.raises(InputError, match=message):
        checkpoints.start(folder and tmp_path / folder, resume, settings)


def test_metadata_is_plain_json(tmp_path):
    save(tmp_path, 1)
    saved = json.loads((tmp_path / "epoch-0001.json").read_text())
    assert saved["epoch"] == 1 and saved["state"] == "epoch-0001.pt" and saved["settings"]["IMAGE_SIZE"] == [64, 64]


def test_a_saver_that_writes_a_folder_is_renamed_whole_and_pruned(tmp_path):
    def write_folder(path):
        path.mkdir()
        (path / "state.index").write_text("index")
        (path / "state.data").write_text("data")

    for epoch in (1, 2, 3):
        checkpoints.save(tmp_path, epoch, ".tf", write_folder, SETTINGS, {})
    newest = checkpoints.complete(tmp_path)[-1]
    assert newest.epoch == 3 and sorted(p.name for p in newest.state.iterdir()) == ["state.data", "state.index"]
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "epoch-0002.json",
        "epoch-0002.tf",
        "epoch-0003.json",
        "epoch-0003.tf",
    ]


def test_a_state_left_without_its_json_by_a_kill_is_replaced(tmp_path):
    (tmp_path / "epoch-0001.pt").write_bytes(b"from the killed run")
    save(tmp_path, 1)
    assert (tmp_path / "epoch-0001.pt").read_bytes() == b"state 1"


def test_a_training_process_finds_the_history_from_the_state_path(tmp_path):
    state = save(tmp_path, 2)
    found = checkpoints.of_state(str(state))
    assert found.epoch == 2 and found.state == state and found.history == {"epoch_seconds": [1.0, 1.0]}
