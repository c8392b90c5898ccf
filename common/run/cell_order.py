"""Cells run out of order, or again, stop with a message that names the cell to run first.

A notebook is read top to bottom, but in a kernel every cell can run at any time: Train before Data, the Data cell
again after its parameters changed, Train twice on the same model. Python then either fails far from the cause (a
``NameError``) or, worse, runs on stale state: a traced step bound to the previous model, a record of epochs that ran
twice. ``watch(notebook)``, called from a notebook's first code cell, checks each cell before it runs:

- every code cell above it has run in this kernel, in order (a cell that ran before a cell above it was run again
  works on out-of-date state): otherwise it names the first cell to run again and the section it is in;
- a cell tagged ``run-once`` (the training loops, which go on from the state they leave) runs again only after the
  section above it has run again, also when it was interrupted: otherwise it names that section.

Hidden answer cells (tag ``answer``) and cells that are not in the saved notebook (papermill's injected parameters, a
cell typed into the kernel) are not checked. Headless runs execute the cells in order and never trip it.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass
from pathlib import Path

RUN_ONCE, ANSWER = "run-once", "answer"
# A cell edited since the notebook was last saved still matches its saved source above this similarity.
SIMILAR = 0.8


class CellOrderError(RuntimeError):
    """A cell that needs other cells to run first; shown as its message alone, without a traceback."""

    def _render_traceback_(self) -> list[str]:  # IPython shows these lines instead of a traceback
        return [f"\x1b[31m{type(self).__name__}\x1b[0m: {self}"]


@dataclass(frozen=True)
class Cell:
    index: int  # among the notebook's code cells
    section: str  # the "## " heading above it
    source: str
    tags: frozenset[str] = frozenset()

    @property
    def name(self) -> str:
        first = next((line for line in self.source.splitlines() if line.strip()), "")
        return f'the cell under "## {self.section}" that starts `{first[:60]}`'


def read_cells(notebook: Path) -> list[Cell]:
    """The code cells of a saved notebook, each with the ``##`` section it is in."""
    section, cells = "", []
    for cell in json.loads(Path(notebook).read_text())["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            heading = next((line[3:].strip() for line in source.splitlines() if line.startswith("## ")), None)
            section = heading or section
        elif cell["cell_type"] == "code":
            tags = frozenset(cell.get("metadata", {}).get("tags", ()))
            cells.append(Cell(len(cells), section, source, tags))
    return cells


def find(cells: list[Cell], source: str) -> Cell | None:
    """The saved cell this source is: the same text, or else the most similar one (an edit not saved yet)."""
    source = source.strip()
    for cell in cells:
        if cell.source.strip() == source:
            return cell
    ratios = [difflib.SequenceMatcher(None, cell.source.strip(), source).ratio() for cell in cells]
    best = max(range(len(cells)), key=ratios.__getitem__, default=None)
    return cells[best] if best is not None and ratios[best] > SIMILAR else None


def problem(cells: list[Cell], ran: dict[int, int], cell: Cell) -> str | None:
    """Why ``cell`` may not run now, or None. ``ran`` maps a code cell's index to when it last ran (a counter)."""
    if ANSWER in cell.tags:
        return None
    above = [c for c in cells[: cell.index] if ANSWER not in c.tags]
    newest, newest_cell = -1, None
    for earlier in above:
        if earlier.index not in ran:
            return f"{earlier.name} has not run in this kernel yet. Run the cells from it down to this one first."
        if ran[earlier.index] < newest:
            return (
                f"{newest_cell.name} was run again after {earlier.name} below it, so what the lower one made is out "
                "of date. Run the cells from the lower one down to this one again first."
            )
        newest, newest_cell = ran[earlier.index], earlier
    if RUN_ONCE in cell.tags and cell.index in ran and above:
        sections = list(dict.fromkeys(c.section for c in above))
        before = sections[-2] if cell.section == sections[-1] and len(sections) > 1 else sections[-1]
        start = next(c for c in above if c.section == before)
        if ran[start.index] < ran[cell.index]:
            return (
                f"{cell.name} has already run, and running it again would go on from where it stopped. To start "
                f'again, run the cells from "## {before}" down to this one first.'
            )
    return None


class Watch:
    """The IPython hooks: an input transformer that replaces a cell that may not run by a raise of
    :class:`CellOrderError`, and a ``post_run_cell`` callback that notes each cell that ran without an error."""

    def __init__(self, shell, notebook: Path):
        self.shell, self.notebook, self.ran, self.runs = shell, notebook, {}, 0
        self._read: tuple[tuple, list[Cell]] = ((), [])  # the notebook file's mtime and size, and its cells

    def cells(self) -> list[Cell]:
        """The saved notebook's cells, read again only once it was saved since (every cell asks two or three times)."""
        try:
            stat = self.notebook.stat()
            saved = (stat.st_mtime_ns, stat.st_size)  # the size too: a file system may keep coarse times
            if saved != self._read[0]:
                self._read = (saved, read_cells(self.notebook))
        except (OSError, ValueError, KeyError):
            self._read = ((), [])
        return self._read[1]

    def transform(self, lines: list[str]) -> list[str]:
        cells = self.cells()
        cell = find(cells, "".join(lines))
        reason = cell and problem(cells, self.ran, cell)
        if not reason:
            return lines
        reason += " (`common.run.cell_order.stop()` turns this check off.)"
        return [f"raise __import__('common.run.cell_order').run.cell_order.CellOrderError({reason!r})\n"]

    def post_run_cell(self, result) -> None:
        cell = find(self.cells(), result.info.raw_cell or "")
        # a run-once cell that stopped half-way (the stop button) has changed its state all the same
        refused = isinstance(result.error_before_exec or result.error_in_exec, CellOrderError)
        if cell is not None and not refused and (result.success or RUN_ONCE in cell.tags):
            self.runs += 1
            self.ran[cell.index] = self.runs


_watch: Watch | None = None


def notebook_path(name: str) -> Path | None:
    """The running notebook: the path Jupyter gives the kernel, or else ``name`` in the working folder."""
    for candidate in (os.environ.get("JPY_SESSION_NAME"), name):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def watch(name: str) -> None:
    """Check every later cell of notebook ``name`` (its file name) before it runs; a no-op outside IPython."""
    global _watch
    try:
        shell = get_ipython()  # noqa: F821 (IPython's builtin)
    except NameError:
        return
    path = notebook_path(name)
    if shell is None or path is None:
        return
    stop()
    _watch = Watch(shell, path)
    shell.input_transformers_post.append(_watch.transform)
    shell.events.register("post_run_cell", _watch.post_run_cell)
    # the cell that calls watch() is running now: post_run_cell notes it when it ends


def stop() -> None:
    """Turn the check off for this kernel."""
    global _watch
    if _watch is None:
        return
    _watch.shell.input_transformers_post.remove(_watch.transform)
    _watch.shell.events.unregister("post_run_cell", _watch.post_run_cell)
    _watch = None
