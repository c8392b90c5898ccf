"""Cells run out of order, twice, or after a cell above them ran again: a message naming the cell to run first."""

import nbformat
import pytest
from jupyter_client.manager import start_new_kernel

from common.run import cell_order
from common.run.cell_order import Cell

KERNEL = "python3"  # the tools environment's own: the check is framework-neutral

SECTIONS = {
    "Setup": ["from common.run import cell_order\ncell_order.watch('demo.ipynb')"],
    "Parameters": ["EPOCHS = 2"],
    "Data": ["data = list(range(EPOCHS))"],
    "Model": ["weights = [0]"],
    "Train": ["def step(x):\n    return x + 1", "for x in data:\n    weights.append(step(x))\ntrained = True"],
    "Exercises": ["print(EPOCHS)"],
}
SETUP, PARAMETERS, DATA, MODEL, STEP, TRAIN, ANSWER = range(7)


def demo_notebook() -> nbformat.NotebookNode:
    cells = []
    for section, sources in SECTIONS.items():
        cells.append(nbformat.v4.new_markdown_cell(f"## {section}\n\nWhy this section."))
        cells += [nbformat.v4.new_code_cell(source) for source in sources]
    code = [cell for cell in cells if cell.cell_type == "code"]
    code[TRAIN].metadata["tags"] = [cell_order.RUN_ONCE]
    code[ANSWER].metadata["tags"] = [cell_order.ANSWER]
    return nbformat.v4.new_notebook(cells=cells)


@pytest.fixture
def cells(tmp_path) -> list[Cell]:
    path = tmp_path / "demo.ipynb"
    nbformat.write(demo_notebook(), path)
    return cell_order.read_cells(path)


def test_cells_know_their_section_and_tags(cells):
    assert [cell.section for cell in cells] == ["Setup", "Parameters", "Data", "Model", "Train", "Train", "Exercises"]
    assert cells[TRAIN].tags == {cell_order.RUN_ONCE} and cells[DATA].tags == set()


def test_cells_run_from_the_top_in_order_may_run(cells):
    ran = {}
    for cell in cells:
        assert cell_order.problem(cells, ran, cell) is None
        ran[cell.index] = len(ran) + 1


def test_a_cell_before_the_cells_it_needs_names_the_first_one_missing(cells):
    reason = cell_order.problem(cells, {SETUP: 1, PARAMETERS: 2}, cells[TRAIN])
    assert reason.startswith('the cell under "## Data" that starts `data = list(range(EPOCHS))` has not run')


def test_a_cell_above_run_again_makes_the_cells_after_it_out_of_date(cells):
    # the parameters changed and ran again after Data: Data's list is stale, and Train must not use it
    ran = {SETUP: 1, PARAMETERS: 6, DATA: 3, MODEL: 4, STEP: 5}
    reason = cell_order.problem(cells, ran, cells[TRAIN])
    assert reason.startswith('the cell under "## Parameters"') and 'after the cell under "## Data"' in reason
    assert "what the lower one made is out of date. Run the cells from the lower one down" in reason


def test_a_run_once_cell_runs_again_only_after_the_section_above_it(cells):
    ran = {SETUP: 1, PARAMETERS: 2, DATA: 3, MODEL: 4, STEP: 5, TRAIN: 6}
    reason = cell_order.problem(cells, ran, cells[TRAIN])
    assert "has already run" in reason and 'run the cells from "## Model"' in reason
    assert cell_order.problem(cells, {**ran, MODEL: 7, STEP: 8}, cells[TRAIN]) is None
    assert cell_order.problem(cells, ran, cells[STEP]) is None, "any other cell may run again"


def test_answer_cells_are_not_checked(cells):
    assert cell_order.problem(cells, {}, cells[ANSWER]) is None


def test_a_cell_is_found_by_its_source_or_an_edit_not_yet_saved(cells):
    assert cell_order.find(cells, "  EPOCHS = 2\n") is cells[PARAMETERS]
    assert cell_order.find(cells, "data = list(range(EPOCHS + 1))") is cells[DATA]
    assert cell_order.find(cells, "print('something typed into the kernel')") is None


def with_source(notebook: nbformat.NotebookNode, index: int, source: str) -> nbformat.NotebookNode:
    """The notebook with code cell ``index`` edited and saved, as a person does in JupyterLab."""
    [cell for cell in notebook.cells if cell.cell_type == "code"][index].source = source
    return notebook


def run(client, source: str) -> dict:
    """Execute ``source`` in the kernel; its error (``ename``, ``evalue``, ``traceback``) or an empty dict."""
    errors = []

    def keep(message):
        if message["msg_type"] == "error":
            errors.append(message["content"])

    client.execute_interactive(source, timeout=60, output_hook=keep)
    return errors[0] if errors else {}


def test_in_a_kernel_a_cell_out_of_order_stops_before_it_runs(tmp_path):
    notebook = demo_notebook()
    nbformat.write(notebook, tmp_path / "demo.ipynb")
    code = [cell.source for cell in notebook.cells if cell.cell_type == "code"]
    manager, client = start_new_kernel(kernel_name=KERNEL, cwd=str(tmp_path))
    try:
        for index in (SETUP, PARAMETERS):
            assert run(client, code[index]) == {}
        error = run(client, code[TRAIN])  # before Data: a NameError deep in the cell without the check
        assert error["ename"] == "CellOrderError" and '"## Data"' in error["evalue"]
        assert len(error["traceback"]) == 1, "the message alone, no traceback"
        assert run(client, "assert 'trained' not in dir()") == {}, "the refused cell ran"
        for index in (DATA, MODEL, STEP, TRAIN):
            assert run(client, code[index]) == {}
        assert run(client, code[TRAIN])["ename"] == "CellOrderError", "a second training would go on from the first"
        for index in (MODEL, STEP):
            assert run(client, code[index]) == {}
        interrupted = code[TRAIN] + "\nraise KeyboardInterrupt"  # the stop button, once the loop has changed weights
        nbformat.write(with_source(notebook, TRAIN, interrupted), tmp_path / "demo.ipynb")
        assert run(client, interrupted)["ename"] == "KeyboardInterrupt"
        assert run(client, interrupted)["ename"] == "CellOrderError", "an interrupted training changed the weights"
        assert run(client, "x = 1") == {}, "a cell of the user's own is not checked"
        assert run(client, "from common.run import cell_order\ncell_order.stop()") == {}
        assert run(client, code[TRAIN]) == {}, "stop() turns the check off"
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
