"""Finds runs of code lines repeated between notebooks, so shared code moves into common/ instead of being copied.

Usage: python tests/notebook_repeats.py [--min-lines N]   (exit code 1 when a repeat is not in ALLOWED)
"""

import argparse
import io
import re
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

import nbformat

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))

# Deliberate repeats: each names a distinctive snippet of the repeated (normalized) text, the pair of notebooks
# (None: any pair) and the framework difference that keeps the code in each notebook rather than in common/.
# Example: {"snippet": "model = densenet121(", "notebooks": {"A.ipynb", "B.ipynb"}, "reason": "..."}
ALLOWED: list[dict] = [
    {
        "snippet": "policy = tfu.set_precision(PRECISION, hardware.kind)",
        "notebooks": {"Keras_TF_MultiGPU.ipynb", "Tensorflow_MultiGPU.ipynb"},
        "reason": "one framework: both configure TensorFlow's devices, strategy and precision policy alike and part "
        "ways at the training loop (a custom loop against model.fit), which is what the pair teaches",
    },
    {
        "snippet": "model = tu.build_densenet121(pretrained=PRETRAINED)",
        "notebooks": {"PyTorch_ModelParallel.ipynb", "PyTorch_MultiGPU.ipynb"},
        "reason": "one framework, one model: the model-parallel notebook cuts into stages the very torchvision "
        "DenseNet-121 that PyTorch_MultiGPU trains whole, after the same Data section",
    },
]

# Closing brackets and separators alone on a line repeat everywhere and say nothing about copied code.
PUNCTUATION = re.compile(r"[()\[\]{}:,;]+")


@dataclass(frozen=True)
class Repeat:
    """Normalized `lines` found in notebooks a and b.

    Places are (index in notebook.cells, from 0 and counting markdown cells; line in the cell's source, from 1).
    """

    a: str
    a_first: tuple[int, int]
    a_last: tuple[int, int]
    b: str
    b_first: tuple[int, int]
    b_last: tuple[int, int]
    lines: tuple[str, ...]

    def __str__(self) -> str:
        def span(first, last):
            return f"cell {first[0]} line {first[1]} - cell {last[0]} line {last[1]}"

        text = "\n".join("    " + line for line in self.lines)
        return (
            f"{len(self.lines)} lines: {self.a} {span(self.a_first, self.a_last)}"
            f" ~ {self.b} {span(self.b_first, self.b_last)}\n{text}"
        )


def cell_lines(source: str) -> list[str]:
    """The cell's lines, comments and imports blanked out, magics too (a %%writefile body is still Python)."""
    lines = source.splitlines()
    for i, line in enumerate(lines):
        if line.lstrip().startswith(("%", "!")):
            lines[i] = ""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO("\n".join(lines) + "\n").readline))
    except (tokenize.TokenError, SyntaxError):
        # Not Python to tokenize: fall back to the raw lines, losing only the trailing-comment stripping.
        return ["" if line.lstrip().startswith(("#", "import ", "from ")) else line for line in lines]
    first = None  # the first token of the current logical line
    for token in tokens:
        row, col = token.start
        if token.type == tokenize.COMMENT:
            # Tokenize knows a '#' inside a string is no comment.
            lines[row - 1] = lines[row - 1][:col]
        elif token.type in (tokenize.NEWLINE, tokenize.NL) and first is None:
            continue
        elif token.type == tokenize.NEWLINE:
            # A parenthesized import spans several rows: all of them go.
            if first.type == tokenize.NAME and first.string in ("import", "from"):
                for blank in range(first.start[0], row + 1):
                    lines[blank - 1] = ""
            first = None
        elif first is None and token.type not in (tokenize.INDENT, tokenize.DEDENT):
            first = token
    return lines


def normalized(path: Path) -> list[tuple[str, tuple[int, int]]]:
    """The notebook's code as (normalized line, (cell index, line in cell)), cells one after another."""
    result = []
    for index, cell in enumerate(nbformat.read(path, as_version=4).cells):
        # the parameters cell repeats the shared names on purpose: one papermill command line serves every notebook
        if cell.cell_type != "code" or "parameters" in cell.metadata.get("tags", []):
            continue
        for number, line in enumerate(cell_lines(cell.source), start=1):
            line = line.strip()
            if line and not PUNCTUATION.fullmatch(line):
                result.append((line, (index, number)))
    return result


def reason_for(repeat: Repeat, allowed: list[dict]) -> str | None:
    text = "\n".join(repeat.lines)
    for entry in allowed:
        pair = entry.get("notebooks")
        if entry["snippet"] in text and (pair is None or set(pair) == {repeat.a, repeat.b}):
            return entry["reason"]
    return None


def pair_repeats(a: Path, b: Path, min_lines: int) -> list[Repeat]:
    left, right = normalized(a), normalized(b)
    where = {}
    for j, (line, _) in enumerate(right):
        where.setdefault(line, []).append(j)
    repeats = []
    for i, (line, _) in enumerate(left):
        for j in where.get(line, []):
            # A run that extends one line back was already found from its start: report maximal runs once.
            if i and j and left[i - 1][0] == right[j - 1][0]:
                continue
            n = 1
            while i + n < len(left) and j + n < len(right) and left[i + n][0] == right[j + n][0]:
                n += 1
            if n >= min_lines:
                lines = tuple(text for text, _ in left[i : i + n])
                ends = (left[i][1], left[i + n - 1][1], right[j][1], right[j + n - 1][1])
                repeats.append(Repeat(a.name, ends[0], ends[1], b.name, ends[2], ends[3], lines))
    return repeats


def find_repeats(paths, min_lines: int = 6, allowed: list[dict] | None = None) -> list[Repeat]:
    """Maximal runs of min_lines or more normalized lines shared by two notebooks, less those `allowed` explains."""
    allowed = ALLOWED if allowed is None else allowed
    paths = sorted(Path(path) for path in paths)
    return [
        repeat
        for k, a in enumerate(paths)
        for b in paths[k + 1 :]
        for repeat in pair_repeats(a, b, min_lines)
        if reason_for(repeat, allowed) is None
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-lines", type=int, default=6, help="shortest run to report (default 6)")
    args = parser.parse_args(argv)
    repeats = find_repeats(NOTEBOOKS, args.min_lines)
    for repeat in repeats:
        print(repeat, end="\n\n")
    if repeats:
        pairs = {(repeat.a, repeat.b) for repeat in repeats}
        print(f"{len(repeats)} repeated runs of {args.min_lines}+ lines between {len(pairs)} pairs of notebooks")
        return 1
    print(f"no repeated runs of {args.min_lines}+ lines between notebooks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
