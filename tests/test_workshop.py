"""The workshop guide quotes one make run's timings and records, and says "–" for what that run lacks."""

import json

from records import complete_record

from common.measure import results
from common.teach import workshop


def executed(folder, name: str, devices: int, seconds: float) -> None:
    said = {"cell_type": "code", "outputs": [{"text": "2 simulated CPU device(s) sharing 2 cores (1 thread(s) each)"}]}
    notebook = {"cells": [said], "metadata": {"papermill": {"duration": seconds}}, "nbformat": 4, "nbformat_minor": 5}
    (folder / "executed" / f"{name}-{devices}dev.ipynb").write_text(json.dumps(notebook))


def make_run(tmp_path):
    (tmp_path / "executed").mkdir()
    executed(tmp_path, "PyTorch_MultiGPU", 1, 150.0)
    executed(tmp_path, "PyTorch_MultiGPU", 2, 120.0)
    executed(tmp_path, "PyTorch_MultiGPU-Exp-Loss", 2, 90.0)  # its name holds a dash
    executed(tmp_path, "DataParallel_From_Scratch", 2, 60.0)
    for devices, rate, auc in ((1, 50.0, 0.85), (2, 70.0, 0.86)):
        results.write(complete_record(devices=devices, images_per_second=rate, test_auc=auc), tmp_path / "results")
    ram = dict(data=results.IN_RAM, epochs=0, test_auc=None, per_class_auc={})
    for variant, devices, rate in (("single-device", 1, 40.0), ("pipeline-gpipe m=2", 2, 45.0), ("ddp", 2, 60.0)):
        results.write(complete_record(notebook="PyTorch_ModelParallel", variant=variant, devices=devices,
                                      images_per_second=rate, **ram), tmp_path / "results")  # fmt: skip
    return tmp_path


def test_run_minutes_come_from_papermills_timing_of_each_executed_notebook(tmp_path):
    minutes = workshop.run_minutes(make_run(tmp_path))
    assert minutes == {
        ("PyTorch_MultiGPU", 1): 2.5,
        ("PyTorch_MultiGPU", 2): 2.0,
        ("PyTorch_MultiGPU-Exp-Loss", 2): 1.5,
        ("DataParallel_From_Scratch", 2): 1.0,
    }


def test_the_guide_quotes_the_runs_figures_and_marks_what_it_lacks(tmp_path):
    text = workshop.guide(make_run(tmp_path))
    assert "| `PyTorch_MultiGPU`, `DEVICES=1`, then `DEVICES=2` | 2.5 min, 2.0 min |" in text
    assert '| `DataParallel_From_Scratch`, `DEVICES=2`, then `GRADIENTS="local"` | 1.0 min, 1.0 min |' in text
    assert "The test AUC: –, the copies in step" in text, "no record of the opener in this run: no figure"
    assert "50.0 images/s on 1 device,\n  70.0 on 2: a scaling efficiency of\n  70%" in text
    assert "The test AUC: 0.850 on 1 device, 0.860 on 2." in text
    assert "one device alone: 40.0; naive model parallelism" in text and "DDP on the same two devices: 60.0" in text
    assert "m=2: 45.0" in text
    assert "{" not in text, "every placeholder filled"
    assert "(cpu devices on 2 cores, records of " in text
    gluon = next(line for line in text.splitlines() if line.startswith("| `Gluon_MultiGPU`"))
    assert gluon == "| `Gluon_MultiGPU` | – | – | – |", "not in this run: no figure, no guess"


def test_the_guide_is_written_atomically_where_asked(tmp_path):
    (tmp_path / "run").mkdir()
    out = workshop.main([str(make_run(tmp_path / "run")), "--out", str(tmp_path / "docs" / "workshop.md")])
    assert out.read_text().startswith("# Workshop: data vs. model parallelism")


def test_the_guide_states_each_environments_set_up_time_and_disk_as_make_setup_recorded_them(tmp_path, monkeypatch):
    recorded = {
        "tools": {"build": "cpu", "seconds": 36.0, "bytes": int(0.9 * 2**30), "date": "2026-12-05", "cores": 2},
        "pytorch": {"build": "cuda13", "seconds": 75.0, "bytes": int(5.9 * 2**30), "date": "2026-12-05", "cores": 2},
        "tensorflow": {"build": "cpu", "seconds": 48.0, "bytes": 2 * 2**30, "date": "2026-12-05", "cores": 2},
    }
    monkeypatch.setattr(workshop.environments, "install_record", recorded.get)
    text = workshop.guide(make_run(tmp_path))
    assert "Python 3.11 and 6.8 GB free for the PyTorch notebooks" in text
    pytorch = next(line for line in text.splitlines() if line.startswith("| `pytorch` |"))
    assert "`PyTorch_MultiGPU`, `PyTorch_MultiGPU-Exp-Loss`" in pytorch and pytorch.endswith("| 1.2 min | 5.9 GB |")
    assert "| `mxnet-chainer` | not installed on the machine that wrote this guide | – | – |" in text
    assert 'make setup FRAMEWORKS="pytorch"' in text
