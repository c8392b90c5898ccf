"""The repeat finder behind `make lint`: what counts as a repeat between notebooks, and the real notebooks' state."""

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook
from notebook_repeats import NOTEBOOKS, find_repeats, main

SIX = [f"x{i} = step({i})" for i in range(6)]


def write(tmp_path, name, *cells):
    """A notebook of code cells (lists of lines), with a markdown cell first as real notebooks have."""
    path = tmp_path / f"{name}.ipynb"
    notebook = new_notebook(cells=[new_markdown_cell("# title")] + [new_code_cell("\n".join(cell)) for cell in cells])
    nbformat.write(notebook, path)
    return path


def pairs(repeats):
    return {f"{repeat.a.removesuffix('.ipynb')}~{repeat.b.removesuffix('.ipynb')}" for repeat in repeats}


def test_a_six_line_repeat_is_found_with_its_places(tmp_path):
    a = write(tmp_path, "a", ["setup()"], SIX)
    b = write(tmp_path, "b", ["other()", "more()"] + SIX)
    [repeat] = find_repeats([a, b])
    assert (repeat.a, repeat.b) == ("a.ipynb", "b.ipynb")
    assert (repeat.a_first, repeat.a_last) == ((2, 1), (2, 6))
    assert (repeat.b_first, repeat.b_last) == ((1, 3), (1, 8))
    assert list(repeat.lines) == SIX
    assert "a.ipynb cell 2 line 1 - cell 2 line 6 ~ b.ipynb cell 1 line 3 - cell 1 line 8" in str(repeat)


def test_a_five_line_repeat_is_not(tmp_path):
    a = write(tmp_path, "a", SIX[:5] + ["only_in_a()"])
    b = write(tmp_path, "b", SIX[:5] + ["only_in_b()"])
    assert find_repeats([a, b]) == []
    assert len(find_repeats([a, b], min_lines=5)) == 1


def test_comments_blanks_imports_punctuation_and_magics_neither_count_nor_break_a_run(tmp_path):
    noisy = [
        "%%writefile {work_dir}/train.py",
        SIX[0] + "  # why this step",
        "",
        "# a comment of its own",
        "import os",
        "from pathlib import (",
        "    Path,",
        ")",
        "!nvidia-smi",
        SIX[1],
        SIX[2],
        "[",
        "],",
        SIX[3],
        "%time " + SIX[4],
        SIX[4],
        SIX[5],
    ]
    a = write(tmp_path, "a", noisy)
    b = write(tmp_path, "b", SIX)
    [repeat] = find_repeats([a, b])
    assert list(repeat.lines) == SIX
    assert (repeat.a_first, repeat.a_last) == ((1, 2), (1, 17))
    # Five real lines padded with what the normalization drops are still only five.
    assert find_repeats([write(tmp_path, "c", noisy[:-1]), b]) == []


def test_a_hash_inside_a_string_is_no_comment(tmp_path):
    lines = SIX[:5] + ['colour = "#ff0000"  # red']
    a = write(tmp_path, "a", lines)
    b = write(tmp_path, "b", SIX[:5] + ['colour = "#0000ff"'])
    assert find_repeats([a, b]) == []
    assert find_repeats([a, write(tmp_path, "c", lines[:5] + ['colour = "#ff0000"'])]) != []


def test_a_cell_that_does_not_tokenize_is_still_read(tmp_path):
    a = write(tmp_path, "a", SIX + ["unclosed = (1,"])
    b = write(tmp_path, "b", SIX)
    [repeat] = find_repeats([a, b])
    assert list(repeat.lines) == SIX


def test_a_run_may_cross_cells(tmp_path):
    a = write(tmp_path, "a", SIX[:3], SIX[3:])
    b = write(tmp_path, "b", SIX)
    [repeat] = find_repeats([a, b])
    assert (repeat.a_first, repeat.a_last) == ((1, 1), (2, 3))


def test_a_repeat_inside_one_notebook_is_not_reported(tmp_path):
    a = write(tmp_path, "a", SIX, SIX)
    b = write(tmp_path, "b", ["unrelated()"])
    assert find_repeats([a, b]) == []


def test_a_maximal_run_is_reported_once(tmp_path):
    ten = [f"y{i} = step({i})" for i in range(10)]
    a = write(tmp_path, "a", ten)
    b = write(tmp_path, "b", ["before()"] + ten + ["after()"])
    [repeat] = find_repeats([a, b])
    assert list(repeat.lines) == ten


def test_each_pair_of_notebooks_is_reported(tmp_path):
    paths = [write(tmp_path, name, SIX) for name in "abc"]
    assert pairs(find_repeats(paths)) == {"a~b", "a~c", "b~c"}


def test_the_allowlist_suppresses_a_matching_repeat(tmp_path):
    paths = [write(tmp_path, name, SIX) for name in "abc"]
    for_a_and_b = {"snippet": SIX[2], "notebooks": {"a.ipynb", "b.ipynb"}, "reason": "a and b differ in framework"}
    assert pairs(find_repeats(paths, allowed=[for_a_and_b])) == {"a~c", "b~c"}
    for_any_pair = {"snippet": SIX[0], "notebooks": None, "reason": "every framework needs it"}
    assert find_repeats(paths, allowed=[for_any_pair]) == []
    elsewhere = {"snippet": "not in the repeat", "notebooks": None, "reason": "some other code"}
    assert len(find_repeats(paths, allowed=[elsewhere])) == 3


def test_main_says_when_there_is_nothing_to_report(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr("notebook_repeats.NOTEBOOKS", [write(tmp_path, "a", SIX), write(tmp_path, "b", SIX)])
    assert main([]) == 1
    assert "1 repeated runs of 6+ lines between 1 pairs of notebooks" in capsys.readouterr().out
    assert main(["--min-lines", "7"]) == 0
    assert "no repeated runs of 7+ lines between notebooks" in capsys.readouterr().out


def test_the_notebooks_repeat_no_code_but_deliberate_differences():
    repeats = find_repeats(NOTEBOOKS)
    assert not repeats, "\n\n".join(str(repeat) for repeat in repeats)


def test_a_parameters_cell_repeats_on_purpose(tmp_path):
    """Every notebook has the same parameter names, so one papermill command line serves them all."""
    cells = [nbformat.v4.new_code_cell("\n".join(f"NAME_{i} = None" for i in range(8)))]
    cells[0].metadata["tags"] = ["parameters"]
    a, b = (tmp_path / f"{name}.ipynb" for name in "ab")
    for path in (a, b):
        notebook = nbformat.v4.new_notebook()
        notebook.cells = cells
        nbformat.write(notebook, path)
    assert find_repeats([a, b], allowed=[]) == []
