"""Every notebook shares one skeleton: headings, one parameters cell, the project kernel, no outputs."""

import ast
import re
from pathlib import Path

import nbformat
import papermill
import pytest

from common.run import environments
from common.run.headless import COMPARES_PLACEMENTS

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
HEADINGS = [
    "Setup",
    "Parameters",
    "Data",
    "Model",
    "Train",
    "Evaluate",
    "Synthetic-data benchmark",
    "Record",
    "Exercises",
]
PARAMETERS = {
    "DATA_DIR",
    "DEVICES",
    "EPOCHS",
    "BATCH_SIZE_PER_DEVICE",
    "IMAGE_SIZE",
    "MAX_IMAGES",
    "PRECISION",
    "PRETRAINED",
    "SEED",
    "RESULTS_DIR",
    "BENCH_STEPS",
    "PREPARED",
}
# The data-parallel notebooks train for many epochs and can resume; the placement notebooks compare short runs, the
# workshop's opener trains a small network for a minute or two, and PyTorch_Sharded compares ways of holding one
# model in short runs (a sharded checkpoint, torch.distributed.checkpoint, is a lesson of its own): nothing to resume.
CHECKPOINTING = {"CHECKPOINT_DIR", "RESUME"}
SHORT_RUNS = {*COMPARES_PLACEMENTS, "DataParallel_From_Scratch", "PyTorch_Sharded"}


def test_there_are_notebooks():
    assert any(path.stem == "PyTorch_MultiGPU" for path in NOTEBOOKS)


@pytest.fixture(params=NOTEBOOKS, ids=lambda path: path.stem)
def notebook(request):
    return nbformat.read(request.param, as_version=4)


def test_shared_headings_in_order(notebook):
    headings = [
        line[3:].strip()
        for cell in notebook.cells
        if cell.cell_type == "markdown"
        for line in cell.source.splitlines()
        if line.startswith("## ")
    ]
    assert headings == HEADINGS


def test_one_parameters_cell_with_the_shared_names(notebook):
    """Every shared name, so one papermill command line serves every notebook; a notebook may add its own."""
    tagged = [cell for cell in notebook.cells if "parameters" in cell.metadata.get("tags", [])]
    assert len(tagged) == 1
    names = {target.id for node in ast.parse(tagged[0].source).body for target in node.targets}
    assert PARAMETERS <= names, f"missing {sorted(PARAMETERS - names)}"
    assert all(name.isupper() for name in names), f"parameters are UPPER_CASE: {sorted(names)}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_papermill_reads_every_parameter_with_its_help(path, caplog):
    """``papermill --help-notebook`` and its parameter inspection skip a line they cannot parse (one with a second
    "=", even in its comment) with only a logged warning: that parameter then has no default and no help there."""
    found, notebook = papermill.inspect_notebook(path), nbformat.read(path, as_version=4)
    assert set(found) == parameter_names(notebook), caplog.text
    tagged = next(cell for cell in notebook.cells if "parameters" in cell.metadata.get("tags", []))
    commented = {line.split("=")[0].strip() for line in tagged.source.splitlines() if "#" in line}
    assert all(found[name]["help"] for name in commented), "a comment papermill did not read as the help"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_the_shared_checks_of_parameters_and_data_run_above_train(path):
    """A zero batch or a missing data folder is refused by these shared calls (tests/test_params.py,
    tests/test_chestxray.py); the notebook tests run the checks each notebook makes its own way."""
    cells = nbformat.read(path, as_version=4).cells
    train = next(i for i, cell in enumerate(cells) if cell.cell_type == "markdown" and "## Train" in cell.source)
    above = "\n".join(cell.source for cell in cells[:train] if cell.cell_type == "code")
    for call in ("params.fill(", "synthetic.data_dir(DATA_DIR", "chestxray.load("):
        assert call in above, f"{call} is not called above ## Train"


def parameter_names(notebook) -> set[str]:
    tagged = next(cell for cell in notebook.cells if "parameters" in cell.metadata.get("tags", []))
    return {target.id for node in ast.parse(tagged.source).body for target in node.targets}


@pytest.mark.parametrize(
    "path", [path for path in NOTEBOOKS if path.stem not in SHORT_RUNS], ids=lambda path: path.stem
)
def test_data_parallel_notebooks_checkpoint_and_resume(path):
    assert CHECKPOINTING <= parameter_names(nbformat.read(path, as_version=4))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_kernel_of_its_environment(path):
    """Each notebook runs in its framework's environment, through that environment's kernel."""
    notebook, env = nbformat.read(path, as_version=4), environments.for_notebook(path.stem)
    assert notebook.metadata.kernelspec.name == env.kernel
    assert notebook.metadata.kernelspec.display_name == env.display_name
    # the whole of what the kernel reports, so that JupyterLab does not mark a notebook modified as it opens it
    assert set(notebook.metadata.language_info) >= {"codemirror_mode", "file_extension", "mimetype", "name", "version"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_cells_are_checked_for_their_order_and_the_training_loop_runs_once(path):
    """The setup cell watches the cell order (common.run.cell_order); a training loop that goes on from its own state
    (every notebook but the speed-up toolboxes, which only time steps) is tagged to run once per model."""
    cells = nbformat.read(path, as_version=4).cells
    setup = next(cell for cell in cells if cell.cell_type == "code")
    assert f'cell_order.watch("{path.name}")' in setup.source
    run_once = [cell for cell in cells if "run-once" in cell.metadata.get("tags", [])]
    assert len(run_once) == (0 if path.stem.endswith("_Speedups") else 1)


def test_committed_without_outputs(notebook):
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]


def test_valid_nbformat(notebook):
    nbformat.validate(notebook)


def exercises_section(notebook) -> list:
    """The cells after the "## Exercises" heading: the last section of every notebook."""
    start = next(
        i
        for i, cell in enumerate(notebook.cells)
        if cell.cell_type == "markdown" and cell.source.startswith("## Exercises")
    )
    return notebook.cells[start + 1 :]


def test_exercises_with_hidden_answers(notebook):
    """3 to 5 numbered exercises, each saying what to predict, change and look at, then one collapsed answer cell that
    compares this notebook's runs through common.teach.exercises and names only parameters the notebook has."""
    section = exercises_section(notebook)
    titles = [cell.source.splitlines()[0] for cell in section if cell.cell_type == "markdown"]
    numbers = [int(re.fullmatch(r"### Exercise (\d+): .+", title).group(1)) for title in titles]
    assert numbers == list(range(1, len(numbers) + 1)) and 3 <= len(numbers) <= 5, titles
    names = parameter_names(notebook)
    code = "\n".join(cell.source for cell in notebook.cells if cell.cell_type == "code")
    recorded = re.search(r'results\.Run\(\s*"\w+",\s*"([^"]+)"', code).group(1)  # the notebook its records name
    for question, answer in zip(section[::2], section[1::2], strict=True):
        assert question.cell_type == "markdown" and answer.cell_type == "code", question.source[:60]
        for part in ("**Predict:**", "**Change:**", "**Look at:**"):
            assert part in question.source, f"{question.source.splitlines()[0]} lacks {part}"
        assert question.source.rstrip().endswith("Answer (hidden cell below: click to expand and run)")
        assert answer.metadata.get("jupyter", {}).get("source_hidden") is True, answer.source[-80:]
        assert answer.metadata["jupyter"].get("outputs_hidden") is False  # the comparison shows once it ran
        assert "answer" in answer.metadata.get("tags", [])
        lines = [line for line in answer.source.splitlines() if not line.startswith("#")]
        assert lines[0].startswith(f'exercises.compare(RESULTS_DIR, "{recorded}", ') and len(lines) <= 2, lines
        changed = set(re.findall(r"\b([A-Z][A-Z_]+)=", "\n".join(lines))) - {"RESULTS_DIR"}
        assert changed <= names, f"{sorted(changed - names)} are no parameters of this notebook"
