"""The report is built from records only; the run harness checks its input before executing anything."""

import shutil

import pandas as pd
import pytest
from records import complete_record

from common.errors import InputError
from common.measure import report, results
from common.run import devices
from common.run import headless as run


def record(notebook="PyTorch_MultiGPU", devices=1, data="generated", rate=100.0, auc=0.8, **extra):
    return complete_record(
        notebook=notebook,
        devices=devices,
        device_names=[f"cpu:{i}" for i in range(devices)],
        global_batch=16 * devices,
        data=data,
        images_per_second=rate,
        test_auc=auc if data != results.IN_RAM else None,
        **extra,
    )


@pytest.fixture
def results_dir(tmp_path):
    folder = tmp_path / "results"
    samples = pd.DataFrame(
        {
            "seconds": [0.0, 0.5],
            "device": ["cpu", "cpu"],
            "utilization_percent": [50.0, 90.0],
            "memory_mib": [100.0, 120.0],
        }
    )
    results.write(record(devices=1, rate=100.0, auc=0.81), folder, samples)
    results.write(record(devices=2, rate=150.0, auc=0.83), folder, samples)
    results.write(record(devices=1, data="synthetic-in-RAM", rate=120.0), folder)
    results.write(record(devices=2, data="synthetic-in-RAM", rate=200.0), folder)
    return folder


def test_one_row_per_notebook_and_devices_with_scaling(results_dir):
    table = report.summary_table(results.load_all(results_dir))
    assert list(table["devices"]) == [1, 2]
    assert list(table["train_images_per_second"]) == [100.0, 150.0]
    assert list(table["ram_images_per_second"]) == [120.0, 200.0]
    assert table["scaling_efficiency"].tolist() == pytest.approx([1.0, 0.75])
    assert table["test_auc"].tolist() == pytest.approx([0.81, 0.83])


def test_newest_record_wins(results_dir):
    results.write(record(devices=2, rate=180.0, auc=0.9, timestamp="2099-01-01T00:00:00+00:00"), results_dir)
    table = report.summary_table(results.load_all(results_dir))
    assert table.loc[table["devices"] == 2, "train_images_per_second"].item() == 180.0


def test_build_writes_markdown_and_plots(results_dir, tmp_path):
    path = report.build(results_dir, tmp_path / "out")
    text = path.read_text()
    comparison = text.split("\n## ")[0]  # the table before the sections
    rows = [line for line in comparison.splitlines() if line.startswith("| PyTorch_MultiGPU")]
    assert len(rows) == 2 and "75%" in rows[1] and "0.830" in rows[1]
    assert (tmp_path / "out" / "throughput.png").stat().st_size > 0
    assert (tmp_path / "out" / "utilization-PyTorch_MultiGPU-2dev.png").stat().st_size > 0
    diagnosed = text.split("## What held each run back")[1]  # one verdict per run, from common.measure.diagnosis
    assert diagnosed.count("\n| PyTorch_MultiGPU |") == 2 and "common.measure.diagnosis" in diagnosed


def test_the_report_compares_where_each_runs_time_went(results_dir, tmp_path):
    rows = [{"phase": "start-up", "start": 0.0, "seconds": 2.0}, {"phase": "train", "start": 2.0, "seconds": 6.0}]
    results.write(record(devices=2, phases=rows, timestamp="2099-01-01T00:00:00+00:00"), results_dir)
    table = report.phase_table(results.load_all(results_dir))
    assert list(table.index) == ["PyTorch_MultiGPU (2 dev)"]  # the records without phases are left out
    assert table.loc["PyTorch_MultiGPU (2 dev)", "train"] == 6.0 and table["steps share"].item() == 0.75
    text = report.build(results_dir, tmp_path / "out").read_text()
    assert "## Where the time went" in text and "| PyTorch_MultiGPU (2 dev) | 2.0 | 6.0 | 0.0 | 75% |" in text
    assert (tmp_path / "out" / "phases.png").stat().st_size > 0


def test_update_readme_replaces_only_the_results_block(results_dir, tmp_path):
    run_dir = tmp_path / "runs" / "20260101-000000"
    shutil.copytree(results_dir, run_dir / "results")
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{report.README_START}\nold\n{report.README_END}\noutro\n")
    report.update_readme(readme, run_dir)
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith("outro\n") and "old" not in text
    assert text.count("| PyTorch_MultiGPU") == 2 and "20260101-000000" in text


def test_update_readme_fills_the_phases_block_from_the_same_run(results_dir, tmp_path):
    run_dir = tmp_path / "runs" / "20260101-000000"
    shutil.copytree(results_dir, run_dir / "results")
    rows = [{"phase": "start-up", "start": 0.0, "seconds": 1.0}, {"phase": "train", "start": 1.0, "seconds": 3.0}]
    results.write(record(devices=2, phases=rows, timestamp="2099-01-01T00:00:00+00:00"), run_dir / "results")
    readme = tmp_path / "README.md"
    blocks = (report.README_START, report.README_END, report.PHASES_START, report.PHASES_END)
    readme.write_text("{}\nold\n{}\nmiddle\n{}\nold\n{}\n".format(*blocks))
    report.update_readme(readme, run_dir)
    text = readme.read_text()
    assert "old" not in text and "middle" in text and "| PyTorch_MultiGPU (2 dev) | 1.0 | 3.0 | 0.0 | 75% |" in text


def test_parse_value():
    assert run.parse_value("2") == 2
    assert run.parse_value("None") is None
    assert run.parse_value("mixed") == "mixed"
    assert run.parse_value("False") is False


def test_device_counts():
    assert run.device_counts(devices.resolve(None, gpus=[], cores=2)) == [1, 2]
    assert run.device_counts(devices.resolve(None, gpus=["A100"] * 4)) == [1, 4]
    assert run.device_counts(devices.resolve(None, gpus=["A100"])) == [1]


def test_placement_notebooks_run_once_on_the_most_devices():
    assert run.counts_for("PyTorch_MultiGPU", [1, 2, 4]) == [1, 2, 4]
    assert run.counts_for("PyTorch_MultiGPU-Exp-Loss", [1, 2, 4]) == [4]
    assert run.counts_for("PyTorch_MultiGPU-Exp-Loss", [1]) == [1]
    assert run.counts_for("PyTorch_ModelParallel", [1, 2]) == [2]
    assert run.counts_for("PyTorch_ModelParallel", [1]) == []


def test_placement_variants_get_rows_and_plots_of_their_own(tmp_path):
    folder = tmp_path / "results"
    samples = pd.DataFrame({"seconds": [0.0], "device": ["cpu"], "utilization_percent": [50.0], "memory_mib": [9.0]})
    for variant, rate in (("ddp", 60.0), ("dp-gather", 40.0)):
        results.write(record("PyTorch_MultiGPU-Exp-Loss", devices=2, rate=rate, variant=variant), folder, samples)
    results.write(record(devices=2, rate=70.0), folder, samples)
    table = report.summary_table(results.load_all(folder))
    assert list(table["notebook"]) == [
        "PyTorch_MultiGPU",
        "PyTorch_MultiGPU-Exp-Loss (ddp)",
        "PyTorch_MultiGPU-Exp-Loss (dp-gather)",
    ]
    assert list(table["train_images_per_second"]) == [70.0, 60.0, 40.0]
    results.write(record("PyTorch_ModelParallel", devices=2, data=results.IN_RAM, rate=45.0, variant="m=4"), folder)
    row = report.summary_table(results.load_all(folder)).set_index("notebook").loc["PyTorch_ModelParallel (m=4)"]
    assert row["global_batch"] == 32 and row["data"] == results.IN_RAM and row["ram_images_per_second"] == 45.0
    built = report.build(folder, tmp_path / "out").read_text()
    for name in ("PyTorch_MultiGPU-Exp-Loss-ddp-2dev", "PyTorch_MultiGPU-Exp-Loss-dp-gather-2dev"):
        assert f"utilization-{name}.png" in built and (tmp_path / "out" / f"utilization-{name}.png").is_file()


def test_unknown_notebook_is_refused(tmp_path):
    (tmp_path / "PyTorch_MultiGPU.ipynb").write_text("{}")
    with pytest.raises(InputError, match="No notebook named Torch.*choose among PyTorch_MultiGPU"):
        run.find_notebooks(["Torch"], tmp_path)


def test_uneven_global_batch_is_refused_before_any_notebook_runs(tmp_path, capsys):
    with pytest.raises(InputError, match="global batch of 15 does not divide evenly over 2 devices"):
        run.main(["--global-batch", "15", "--devices", "1", "2", "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_the_setup_table_gives_each_environments_time_and_disk_and_the_whole_setups():
    day = {"date": "2026-12-05", "cores": 2, "pip_cache_bytes": 0}
    records = {
        "tools": {"build": "cpu", "started": 1000.0, "seconds": 30.0, "bytes": 2**30, **day},
        "pytorch": {"build": "cuda13", "started": 1001.0, "seconds": 95.0, "bytes": 6 * 2**30, **day},
        "tensorflow": None,
    }
    table = report.setup_table(records)
    assert "on 2026-12-05 (2 cores)" in table and "with 0 MB in pip's cache at the start" in table
    assert "| pytorch | cuda13 | 1.6 min | 6.0 GB |" in table and "| tensorflow | not installed | – | – |" in table
    assert table.splitlines()[-1] == "| **make setup** | | 1.6 min | 7.0 GB |", "side by side: the wall time"


def test_notebooks_whose_environment_is_not_installed_are_skipped_with_the_command_that_installs_it():
    notebooks = run.find_notebooks(None)
    kernels = {"multigpu-pytorch", "multigpu-mxnet-chainer", "python3"}
    kept, skipped = run.runnable(notebooks, kernels)
    assert {path.stem for path in kept} == {
        "PyTorch_MultiGPU", "PyTorch_MultiGPU-Exp-Loss", "PyTorch_ModelParallel", "PyTorch_Speedups",
        "DataParallel_From_Scratch", "PyTorch_Sharded", "Gluon_MultiGPU", "Chainer_MultiGPU",
    }  # fmt: skip
    assert skipped == [
        "JAX_MultiGPU, Keras_JAX_MultiGPU: skipped, the jax environment is not installed (no kernel multigpu-jax): "
        'make setup FRAMEWORKS="jax"',
        "Keras_Speedups, Keras_TF_MultiGPU, Tensorflow_MultiGPU: skipped, the tensorflow environment is not installed "
        '(no kernel multigpu-tensorflow): make setup FRAMEWORKS="tensorflow"',
    ]
