"""Every notebook shares one skeleton: headings, one parameters cell, the project kernel, no outputs."""

import ast
from pathlib import Path

import nbformat
import pytest

from common.kernel import NAME as KERNEL
from common.run import COMPARES_PLACEMENTS

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
HEADINGS = ["Setup", "Parameters", "Data", "Model", "Train", "Evaluate", "Synthetic-data benchmark", "Record"]
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
# The data-parallel notebooks train for many epochs and can resume; the placement notebooks compare short runs.
CHECKPOINTING = {"CHECKPOINT_DIR", "RESUME"}


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


def parameter_names(notebook) -> set[str]:
    tagged = next(cell for cell in notebook.cells if "parameters" in cell.metadata.get("tags", []))
    return {target.id for node in ast.parse(tagged.source).body for target in node.targets}


@pytest.mark.parametrize(
    "path", [path for path in NOTEBOOKS if path.stem not in COMPARES_PLACEMENTS], ids=lambda path: path.stem
)
def test_data_parallel_notebooks_checkpoint_and_resume(path):
    assert CHECKPOINTING <= parameter_names(nbformat.read(path, as_version=4))


def test_project_kernel(notebook):
    assert notebook.metadata.kernelspec.name == KERNEL


def test_committed_without_outputs(notebook):
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]


def test_valid_nbformat(notebook):
    nbformat.validate(notebook)
