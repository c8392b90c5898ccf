"""common.teach.exercises: the answer cells' tables, on records written as the notebooks write them."""

import math

import pytest
from records import complete_record

from common.measure import results
from common.teach import exercises


def phases(train: float, outside: float) -> list[dict]:
    return [
        {"phase": "start-up", "start": 1000.0, "seconds": outside},
        {"phase": "train", "start": 1000.0 + outside, "seconds": train},
    ]


def run(folder, minute: int, devices: int = 2, rate: float = 60.0, in_ram: float | None = 70.0, **changes) -> None:
    """One notebook run's records, at ``minute`` past midnight: the training record and its in-RAM benchmark."""
    shared = dict(
        devices=devices,
        device_names=[f"cpu:{i}" for i in range(devices)],
        global_batch=16 * devices,
        batch_size_per_device=16,
        learning_rate=1e-3 * devices,
        image_size=64,
        prepared_size=73,
        timestamp=f"2026-12-05T00:{minute:02d}:00+00:00",
    )
    training = dict(
        images_per_second=rate,
        phases=phases(train=60.0, outside=40.0),
        data_wait_seconds=[1.0, 1.0, 1.0],
        test_auc=0.85,
        **shared,
    )
    results.write(complete_record(**{**training, **changes}), folder)
    if in_ram is not None:
        bench = dict(data=results.IN_RAM, epochs=0, images_per_second=in_ram, test_auc=None, **shared)
        results.write(complete_record(**{**bench, **changes}), folder)


def test_one_run_names_the_run_still_missing(tmp_path, capsys):
    run(tmp_path, 1, devices=2)
    table = exercises.compare(tmp_path, "PyTorch_MultiGPU", DEVICES=[1, 2])
    printed = capsys.readouterr().out
    assert "Not run yet: DEVICES=1" in printed and "-p DEVICES 1" in printed
    assert "PRECISION='fp32'" in printed and "IMAGE_SIZE=64" in printed  # the settings to keep
    # Run All reaches the answer before the learner's run: no table of the one run, the answer waits
    assert "Nothing to compare yet" in printed and table.empty and table.index.name == "DEVICES"


def test_scaling_efficiency_against_the_one_device_run(tmp_path, capsys):
    run(tmp_path, 1, devices=2, rate=60.0)
    run(tmp_path, 2, devices=1, rate=40.0)
    table = exercises.compare(tmp_path, "PyTorch_MultiGPU", DEVICES=[1, 2])
    assert "Not run yet" not in capsys.readouterr().out
    assert list(table.index) == [1, 2]
    assert table.loc[1, "scaling efficiency"] == 1.0 and table.loc[2, "scaling efficiency"] == 0.75
    assert list(table["learning rate"]) == [0.001, 0.002]
    row = table.loc[2]
    assert row["train img/s"] == 60.0 and row["in-RAM img/s"] == 70.0 and row["test AUC"] == 0.85
    assert row["steps share"] == 0.6 and row["global batch"] == 32 and row["diagnosis"]


def test_the_newest_run_of_each_value_with_the_newest_runs_settings(tmp_path, capsys):
    run(tmp_path, 1, devices=1, rate=30.0)
    run(tmp_path, 2, devices=1, rate=40.0)  # newer: replaces the first
    run(tmp_path, 3, devices=1, rate=50.0, image_size=32)  # another image size: not comparable
    run(tmp_path, 4, devices=2, rate=60.0)
    table = exercises.compare(tmp_path, "PyTorch_MultiGPU", DEVICES=[1, 2])
    assert table.loc[1, "train img/s"] == 40.0 and "Not run yet" not in capsys.readouterr().out
    run(tmp_path, 5, devices=2, rate=60.0, image_size=32)
    table = exercises.compare(tmp_path, "PyTorch_MultiGPU", DEVICES=[1, 2])
    assert table.loc[1, "train img/s"] == 50.0 and table.loc[2, "scaling efficiency"] == 0.6


def test_a_run_with_other_settings_is_named_not_compared(tmp_path, capsys):
    run(tmp_path, 1, devices=1, image_size=32)
    run(tmp_path, 2, devices=2)
    table = exercises.compare(tmp_path, "PyTorch_MultiGPU", DEVICES=[1, 2])
    printed = capsys.readouterr().out
    assert table.empty and "Nothing to compare yet" in printed
    assert "Not run yet: DEVICES=1" in printed and "image_size 32 (newest run: 64)" in printed


def test_prepared_compares_the_pngs_with_the_prepared_copy(tmp_path, capsys):
    run(tmp_path, 1)
    run(tmp_path, 2, rate=20.0, prepared_size=None, data_wait_seconds=[9.0, 9.0, 9.0])
    table = exercises.compare(tmp_path, "PyTorch_MultiGPU", PREPARED=[True, False])
    assert "Not run yet" not in capsys.readouterr().out
    assert list(table.index) == [True, False] and table.loc[False, "train img/s"] == 20.0
    assert table.loc[False, "waiting share"] > table.loc[True, "waiting share"]


def test_a_framework_parameter_is_a_record_field(tmp_path, capsys):
    run(tmp_path, 1, framework="keras", notebook="Keras_TF_MultiGPU", strategy="mirrored")
    table = exercises.compare(tmp_path, "Keras_TF_MultiGPU", STRATEGY=["mirrored", "central_storage"])
    printed = capsys.readouterr().out
    assert table.empty and "Nothing to compare yet" in printed
    assert "STRATEGY='central_storage'" in printed and "-p STRATEGY central_storage" in printed


def test_variants_of_in_ram_benchmarks_with_what_to_change(tmp_path, capsys):
    for batch in (4, 8):
        bench = dict(notebook="PyTorch_Speedups", data=results.IN_RAM, epochs=0, test_auc=None, devices=1)
        measured = dict(global_batch=batch, images_per_second=batch * 5.0, first_steps_seconds=1.5)
        results.write(complete_record(**bench, **measured, variant=f"batch size: batch {batch}"), tmp_path)
    results.write(
        complete_record(notebook="PyTorch_Speedups", data=results.IN_RAM, variant="precision: fp32"), tmp_path
    )
    how = "BATCH_SIZES=[4, 8, 16, 32]"
    table = exercises.compare(tmp_path, "PyTorch_Speedups", variant="batch size", global_batch=[4, 8, 16, 32], how=how)
    header, *missing = capsys.readouterr().out.splitlines()
    assert list(table.index) == [4, 8] and list(table["images/s"]) == [20.0, 40.0]
    assert "global batch" not in table  # the index already
    assert "IMAGE_SIZE=64" in header and "DEVICES" not in header  # a benchmark's devices are its own
    sentence = f"Not run yet: global_batch=16, global_batch=32. To compare, run this notebook with {how}, then this"
    assert missing == [sentence + " cell again."]
    everything = exercises.compare(tmp_path, "PyTorch_Speedups", variant="batch size")
    assert list(everything.index) == ["batch size: batch 4", "batch size: batch 8"]


def test_what_this_machine_cannot_measure_is_said_so(tmp_path, capsys):
    why = {"dp-gather and dp-replica-loss": "nn.DataParallel needs 2 or more GPUs"}
    run(tmp_path, 1, notebook="PyTorch_MultiGPU-Exp-Loss", variant="ddp", not_measured=why)
    table = exercises.compare(tmp_path, "PyTorch_MultiGPU-Exp-Loss", WAYS=["dp-gather", "ddp"])
    printed = capsys.readouterr().out
    assert list(table.index) == ["ddp"]  # the only way this machine runs: the answer, nothing to wait for
    assert "WAYS='dp-gather' is not measured on this machine" in printed and "needs 2 or more GPUs" in printed


def test_nested_fields_as_columns(tmp_path, capsys):
    for m in (1, 2):
        bubble = {"micro_batches": m, "textbook": 1 / (m + 1), "measured": [0.61234, 0.4]}
        bench = dict(notebook="PyTorch_ModelParallel", data=results.IN_RAM, variant=f"pipeline m={m}")
        results.write(complete_record(**bench, micro_batches=m, bubble=bubble), tmp_path)
    fields, how = ("bubble.textbook", "bubble.measured"), "MICRO_BATCHES=(1, 2, 4)"
    table = exercises.compare(
        tmp_path, "PyTorch_ModelParallel", variant="pipeline m=", micro_batches=[1, 2, 4], fields=fields, how=how
    )
    assert list(table["bubble.textbook"]) == [0.5, 0.333] and table.loc[1, "bubble.measured"] == [0.612, 0.4]
    assert "MICRO_BATCHES=(1, 2, 4)" in capsys.readouterr().out


def test_no_records_yet_is_a_sentence_not_an_error(tmp_path, capsys):
    run(tmp_path, 1, notebook="Gluon_MultiGPU")  # another notebook's records do not count
    assert exercises.compare(tmp_path / "absent", "PyTorch_MultiGPU", DEVICES=[1, 2]).empty
    assert exercises.compare(tmp_path, "PyTorch_MultiGPU", DEVICES=[1, 2]).empty
    assert capsys.readouterr().out.count("run this notebook (Run All)") == 2


def test_one_parameter_at_a_time(tmp_path):
    with pytest.raises(ValueError, match="one parameter at a time"):
        exercises.compare(tmp_path, "PyTorch_MultiGPU", DEVICES=[1, 2], PRECISION=["fp32"])


def test_values_are_rounded_for_reading():
    assert exercises._rounded(47.3456) == 47.3 and exercises._rounded(1234.56) == 1234.6
    assert exercises._rounded(0.000123456) == 0.000123 and math.isnan(exercises._rounded(math.nan))
