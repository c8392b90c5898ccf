"""Executing a notebook headless, as the notebook tests of every framework do.

One place for the papermill call, the 1-and-2-device runs, the bad-input check and nbval,
so every framework's notebook is held to the same bars.
"""

import concurrent.futures
import contextlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import nbformat
import papermill
import pytest

from common.measure import results
from common.run import checkpoints, environments

NOTEBOOK_DIR = Path(__file__).parent.parent / "notebooks"
# Two epochs on 800 generated 64-pixel images reach a mean test AUC of about 0.82-0.85 on 1 and on 2 devices in
# PyTorch_MultiGPU and DataParallel_From_Scratch (PyTorch_MultiGPU at 2 devices: 0.86 after a third epoch, which costs
# a third more training time); 0.70 is the bar for "learned", well clear of chance (0.5) and of run-to-run noise.
AUC_BAR = 0.70
# The same model, data and scaling rule on 1 and 2 devices must land close: a data-parallel bug
# (unsynchronized replicas, a shard scored twice, the 2018 Chainer drop) shows as a larger gap.
AUC_GAP = 0.05
PROGRESS_BAR = re.compile(r"\d+%\|.*\| *\d+/\d+")  # a tqdm bar: "epoch 1/3:  50%|#####     | 5/10 [...]"


def noise(text: str) -> list[str]:
    """The lines of a stderr output but tqdm's progress bars: log lines, warnings and tracebacks, all in red."""
    return [line for line in re.split(r"[\r\n]", text) if line.strip() and not PROGRESS_BAR.search(line)]


def stderr_noise(notebook: Path) -> list[str]:
    """What the cells of an executed notebook wrote to stderr but progress bars."""
    cells = nbformat.read(notebook, as_version=4).cells
    streams = [out for cell in cells if cell.cell_type == "code" for out in cell.outputs if out.output_type == "stream"]
    return [line for out in streams if out.name == "stderr" for line in noise(out.text)]


def without_pytest_marker() -> dict[str, str]:
    """This process's environment for a kernel that behaves as a user's: ipykernel leaves what a kernel writes to file
    descriptor 2 (C++ log lines) out of the notebook when it finds PYTEST_CURRENT_TEST, which every kernel started
    from a test inherits; without it the executed notebook holds those lines, as JupyterLab shows them."""
    return {name: value for name, value in os.environ.items() if name != "PYTEST_CURRENT_TEST"}


@contextlib.contextmanager
def kernels_as_a_users():
    """Kernels started inside behave as a user's (see :func:`without_pytest_marker`). Only the one variable is taken
    out and put back: clearing and refilling ``os.environ`` would leave it empty for a moment, in which a process that
    another thread starts would get no environment at all."""
    marker = os.environ.pop("PYTEST_CURRENT_TEST", None)
    try:
        yield
    finally:
        if marker is not None:
            os.environ["PYTEST_CURRENT_TEST"] = marker


def printed(executed: Path) -> str:
    """All the text the cells of an executed notebook printed, in order."""
    cells = nbformat.read(executed, as_version=4).cells
    return "".join(output.get("text", "") for cell in cells for output in cell.get("outputs", []))


def notebook_path(name: str) -> Path:
    return NOTEBOOK_DIR / f"{name}.ipynb"


def marks(*notebooks: str) -> pytest.MarkDecorator:
    """The mark of a test that runs these notebooks: it needs their environments' kernels."""
    return pytest.mark.environments(*sorted({environments.for_notebook(name).name for name in notebooks}))


def execute(
    name: str | Path,
    data_dir,
    out_dir: Path,
    *,
    output: Path | None = None,
    prepare_only: bool = False,
    kernel: str | None = None,
    **parameters,
) -> Path:
    """Run notebook ``name`` (or the notebook at that path) with papermill, in a kernel that behaves as a user's (or
    only fill in its parameters); records go to ``out_dir/results``. The kernel is the one the notebook names (its
    environment's), or ``kernel``.

    Returns the executed copy, ``output`` or ``out_dir/executed-<DEVICES>.ipynb``.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    executed = output or out_dir / f"executed-{parameters.get('DEVICES')}.ipynb"
    with kernels_as_a_users():
        papermill.execute_notebook(
            name if isinstance(name, Path) else notebook_path(name),
            executed,
            prepare_only=prepare_only,
            kernel_name=kernel,
            cwd=NOTEBOOK_DIR,
            progress_bar=False,
            parameters={"DATA_DIR": str(data_dir), "RESULTS_DIR": str(out_dir / "results"), **parameters},
        )
    return executed


def records_by_devices(
    name: str,
    data_dir,
    out: Path,
    side_by_side: bool = False,
    checkpoints: int | None = None,
    then: Callable[[Path], None] | None = None,
    **parameters,
) -> dict[int, dict[str, dict]]:
    """Run the notebook on 1 device under nbval (cell by cell, failing on any error, as a person runs it) and on 2
    with papermill, one after the other or ``side_by_side``: ``{devices: {data kind: record}}``. The run on
    ``checkpoints`` devices, if given, saves one after every epoch in ``out/<checkpoints>/checkpoints``, and ``then``
    is called with that folder as soon as it is done, beside the other run if that one is still going."""
    saved = out / str(checkpoints) / "checkpoints"

    def run(devices: int) -> None:
        saving = {"CHECKPOINT_DIR": str(saved)} if devices == checkpoints else {}
        if devices == 1:
            run_nbval(name, data_dir, out / "1", DEVICES=1, **saving, **parameters)
        else:
            execute(name, data_dir, out / "2", DEVICES=2, **saving, **parameters)
        if devices == checkpoints and then is not None:
            then(saved)

    with kernels_as_a_users():  # once around both threads: each putting the marker back would race the other
        if side_by_side:
            with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
                two = pool.submit(run, 2)
                run(1)
                two.result()
        else:
            run(1)
            run(2)
    return {devices: {r["data"]: r for r in results.load_all(out / str(devices) / "results")} for devices in (1, 2)}


def check_training_record(record: dict, *, framework: str, notebook: str, devices: int, parameters: dict) -> None:
    """The fields every training record must carry, with the values the run was given."""
    assert set(results.REQUIRED) <= set(record)
    assert record["framework"] == framework and record["notebook"] == notebook
    assert record["devices"] == devices and record["device_kind"] == "cpu"
    assert record["global_batch"] == parameters["BATCH_SIZE_PER_DEVICE"] * devices
    assert len(record["epoch_seconds"]) == parameters["EPOCHS"] and record["images_per_second"] > 0
    assert len(record["per_class_auc"]) == 14
    assert record["device_utilization"]["cpu"]["memory_peak_mib"] > 0
    assert Path(record["path"]).with_name(record["utilization_csv"]).is_file()


def assert_stops_before_training(name: str, data_dir, tmp_path: Path, parameters: dict, message: str) -> None:
    """Bad input raises ``InputError`` naming ``message``, no cell under "## Train" ran, no record was written."""
    with pytest.raises(papermill.PapermillExecutionError) as error:
        execute(name, data_dir, tmp_path, **{"DEVICES": 1, **parameters})
    assert error.value.ename == "InputError", error.value.evalue
    assert message in error.value.evalue
    executed = nbformat.read(tmp_path / f"executed-{parameters.get('DEVICES', 1)}.ipynb", as_version=4)
    cells = executed.cells
    train = next(i for i, cell in enumerate(cells) if cell.cell_type == "markdown" and "## Train" in cell.source)
    ran = [cell.source[:60] for cell in cells[train:] if cell.cell_type == "code" and cell.execution_count]
    assert not ran, f"training cells ran before the error: {ran}"
    assert not list((tmp_path / "results").glob("*.json")), "a record was written for a run that never trained"


# A refusal costs a kernel's start and its framework's import, one Python thread each: run side by side, the refusals
# of one notebook take little more than the longest of them.
REFUSING_AT_ONCE = 3


def refusals(name: str, data_dir, out: Path, cases: dict[str, tuple[dict, str]]) -> dict[str, BaseException | None]:
    """Give notebook ``name`` each bad input of ``cases`` (``{case: (parameters, what the message names)}``), side by
    side, each checked by :func:`assert_stops_before_training` in ``out/<case>``: ``{case: its failure, or None}``."""
    with kernels_as_a_users(), concurrent.futures.ThreadPoolExecutor(max_workers=REFUSING_AT_ONCE) as pool:
        futures = {
            case: pool.submit(assert_stops_before_training, name, data_dir, out / case, parameters, message)
            for case, (parameters, message) in cases.items()
        }
    return {case: future.exception() for case, future in futures.items()}


def run_nbval(name: str, data_dir, tmp_path: Path, records: int = 2, **parameters) -> None:
    """nbval --nbval-lax over the notebook prepared with ``parameters``; it must write ``records`` records."""
    prepared = execute(name, data_dir, tmp_path, output=tmp_path / f"{name}.ipynb", prepare_only=True, **parameters)
    command = [sys.executable, "-m", "pytest", "--nbval-lax", "-p", "no:cacheprovider", "-q", str(prepared)]
    out = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path)
    # nbval reports the failed cells in order: the first is the cause, the later ones mostly refuse to run after it
    assert out.returncode == 0, out.stdout[:6000] + "\n...\n" + out.stdout[-1500:] + out.stderr[-3000:]
    assert len(list((tmp_path / "results").glob("*.json"))) == records


def records_by_variant(name: str, data_dir, out: Path, records: int, **parameters) -> dict[str, dict]:
    """Run a notebook that writes one record per variant (the speed-up toolboxes) under nbval: ``{variant: record}``."""
    run_nbval(name, data_dir, out, records=records, **parameters)
    return {record["variant"]: record for record in results.load_all(out / "results")}


# Bad input every notebook refuses before training, with the message it must name.
BAD_INPUT = {
    "too-many-devices": ({"DEVICES": 64}, "DEVICES=64 but"),
    "missing-data": ({"DATA_DIR": "/nonexistent/chestxray"}, "does not exist"),
    "zero-batch": ({"BATCH_SIZE_PER_DEVICE": 0}, "BATCH_SIZE_PER_DEVICE must be a positive integer"),
    # the training split of the stand-in holds a few hundred images: an epoch of this global batch takes no step
    "fewer-than-one-batch": ({"BATCH_SIZE_PER_DEVICE": 4096}, "fewer than one global batch"),
}

IN_EACH_NOTEBOOK = ("too-many-devices", "fewer-than-one-batch")


class NotebookContract:
    """What every training notebook must do, run on 1 (under nbval) and 2 simulated CPU devices.

    A test module subclasses it as ``class Test...(NotebookContract)`` and names the notebook, its
    framework and the tiny parameters it trains with; it may add tests of its own.
    """

    NOTEBOOK: str
    FRAMEWORK: str
    TINY = dict(EPOCHS=2, IMAGE_SIZE=64, BATCH_SIZE_PER_DEVICE=16, BENCH_STEPS=2)
    # Run the 1- and 2-device runs at once: a notebook whose runs leave a core idle for long (graph tracing is one
    # Python thread) finishes both sooner; one that keeps both cores busy would only slow both down.
    SIDE_BY_SIDE = False
    # What the commands printed under "More than one machine" must carry so that every process of a two-machine run
    # trains this run (its global batch and learning rate, its parameters).
    MULTI_MACHINE: str | None  # None: the notebook trains in one process and prints no such commands
    # The device count whose run saves a checkpoint after every epoch (ResumeContract resumes from them), or None.
    CHECKPOINTS: int | None = None
    # The notebook's own bad input beside IN_EACH_NOTEBOOK's: {case: (parameters, what the message names)}
    REFUSALS: dict[str, tuple[dict, str]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if hasattr(cls, "NOTEBOOK"):  # not on an intermediate contract (ResumeContract)
            cls.pytestmark = [*getattr(cls, "pytestmark", []), marks(cls.NOTEBOOK)]

    @pytest.fixture(scope="class")
    @classmethod
    def run_dir(cls, tmp_path_factory):
        return tmp_path_factory.mktemp("runs")

    @pytest.fixture(scope="class")
    @classmethod
    def runs(cls, notebook_data, run_dir):
        return records_by_devices(cls.NOTEBOOK, notebook_data, run_dir, cls.SIDE_BY_SIDE, cls.CHECKPOINTS, **cls.TINY)

    @pytest.mark.parametrize("devices", [1, 2])
    def test_records_are_complete(self, runs, devices):
        assert set(runs[devices]) == {"generated", results.IN_RAM}
        check_training_record(
            runs[devices]["generated"],
            framework=self.FRAMEWORK,
            notebook=self.NOTEBOOK,
            devices=devices,
            parameters=self.TINY,
        )
        assert runs[devices][results.IN_RAM]["images_per_second"] > 0

    @pytest.mark.parametrize("devices", [1, 2])
    def test_learns_above_the_bar(self, runs, devices):
        assert runs[devices]["generated"]["test_auc"] > AUC_BAR

    def test_one_and_two_devices_reach_the_same_auc(self, runs):
        auc1, auc2 = (runs[d]["generated"]["test_auc"] for d in (1, 2))
        assert abs(auc1 - auc2) < AUC_GAP, f"1 device: {auc1:.3f}, 2 devices: {auc2:.3f}"

    def test_writes_nothing_to_stderr_but_progress_bars(self, runs, run_dir):
        """No noise in red: start-up notices, log lines, warnings (the 2-device run, as papermill saved it)."""
        assert not stderr_noise(run_dir / "2" / "executed-2.ipynb")

    def test_prints_multi_machine_commands_for_the_whole_run(self, runs, run_dir):
        shown = printed(run_dir / "2" / "executed-2.ipynb")
        if self.MULTI_MACHINE is None:
            assert "host2" not in shown, "commands for a multi-machine run that this notebook does not support"
        else:
            assert "host2" in shown and self.MULTI_MACHINE in shown

    # Each framework finds its own devices, and too few images for a step is the last check before training (in
    # **Data**); a zero batch and a missing folder are refused by the shared params.fill and synthetic.data_dir
    # (tests/test_params.py, tests/test_chestxray.py), which tests/test_structure.py finds above "## Train" in every
    # notebook.
    @classmethod
    def refusal_cases(cls) -> dict[str, tuple[dict, str]]:
        return {**{name: BAD_INPUT[name] for name in IN_EACH_NOTEBOOK}, **cls.REFUSALS}

    def pytest_generate_tests(self, metafunc):
        if metafunc.function.__name__ == "test_bad_input_stops_before_training":
            metafunc.parametrize("case", list(self.refusal_cases()))

    @pytest.fixture(scope="class")
    @classmethod
    def refused(cls, notebook_data, tmp_path_factory):
        return refusals(cls.NOTEBOOK, notebook_data, tmp_path_factory.mktemp("refusals"), cls.refusal_cases())

    def test_bad_input_stops_before_training(self, refused, case):
        if refused[case] is not None:
            raise refused[case]


class ResumeContract(NotebookContract):
    """A :class:`NotebookContract` whose notebook checkpoints and resumes: its run on ``CHECKPOINTS`` devices saves a
    checkpoint after every epoch; with the last one taken away, as if the run had died during its last epoch,
    ``RESUME=True`` on as many devices trains that epoch only and records the whole run. (That a checkpoint survives a
    SIGKILL at any moment is ``common.run.checkpoints.save``'s, shared by every notebook: tests/test_resume.py kills a
    PyTorch run.)"""

    # the resumed run is a third run of the notebook: on the device count whose run is the shorter
    CHECKPOINTS = 1
    SUFFIX: str  # what the file (or folder) of a checkpoint's saved state ends in
    PROGRESS: str  # what the log shows while it trains an epoch: a format of ``epoch`` and ``epochs``

    @pytest.fixture(scope="class")
    @classmethod
    def resumed(cls):
        """What the resumed run left (:meth:`resume`'s result) or raised, once ``runs`` is done."""
        return concurrent.futures.Future()

    @pytest.fixture(scope="class")
    @classmethod
    def runs(cls, notebook_data, run_dir, resumed):
        """The contract's two runs, and the resumed run as soon as the checkpoints it needs exist: beside the other
        run when the two run side by side (a core idles there while the other run compiles its steps). What it raises
        is kept for the resume test: the other tests need only the two runs."""

        def resume(saved: Path) -> None:
            try:
                resumed.set_result(cls.resume(notebook_data, saved, run_dir / "resumed"))
            except Exception as error:  # raised again by the test that needs it
                resumed.set_exception(error)

        return records_by_devices(cls.NOTEBOOK, notebook_data, run_dir, cls.SIDE_BY_SIDE, cls.CHECKPOINTS, resume,
                                  **cls.TINY)  # fmt: skip

    @classmethod
    def resume(cls, data_dir, finished: Path, out: Path) -> tuple[Path, list[checkpoints.Checkpoint]]:
        """Resume a run in ``out`` from a copy of the checkpoints it saved in ``finished``, the last taken away as if
        the run had died before it was saved: the executed notebook and the checkpoints the run left."""
        epochs, saved = cls.TINY["EPOCHS"], out / "checkpoints"
        shutil.copytree(finished, saved)
        written = checkpoints.complete(saved)
        assert [c.epoch for c in written] == [epochs - 1, epochs]  # common.run.checkpoints.KEEP: the newest two
        assert written[-1].state.name == f"epoch-{epochs:04d}{cls.SUFFIX}"
        (saved / f"epoch-{epochs:04d}.json").unlink()
        executed = execute(cls.NOTEBOOK, data_dir, out, CHECKPOINT_DIR=str(saved), RESUME=True,
                           DEVICES=cls.CHECKPOINTS, **cls.TINY)  # fmt: skip
        return executed, written

    def test_resumes_after_its_newest_complete_checkpoint(self, runs, resumed):
        executed, written = resumed.result(timeout=0)
        epochs, out = self.TINY["EPOCHS"], executed.parent
        records = {record["data"]: record for record in results.load_all(out / "results")}
        assert set(records) == {"generated", results.IN_RAM}
        trained = records["generated"]
        assert len(trained["epoch_seconds"]) == len(trained["valid_auc"]) == epochs
        # the epochs before come from the checkpoint, not from training them again
        assert trained["epoch_seconds"][:-1] == written[-2].history["epoch_seconds"]
        assert [c.epoch for c in checkpoints.complete(out / "checkpoints")] == [epochs - 1, epochs]
        log = printed(executed)
        assert f"Resuming after epoch {epochs - 1}" in log
        assert self.PROGRESS.format(epoch=epochs - 1, epochs=epochs) not in log
        assert self.PROGRESS.format(epoch=epochs, epochs=epochs) in log
