"""What the live device view costs the training it watches, measured in a real Jupyter kernel.

    python -m common.measure.bench_live [--rounds 5] [--steps 20] [--size 64] [--batch 16] [--readme README.md]

In the PyTorch environment's kernel (the live view only draws inside one), PyTorch's DenseNet-121 training step on the
CPU runs ``--steps`` steps at a time three ways, in turn for ``--rounds`` rounds so that the machine's drift falls on
all three alike: with no monitor, under a :class:`common.measure.monitor.Monitor` without the live view (what every
notebook did before), and with it. The figure is the median images/s of each, and the live view's cost against each of
the others.
"""

from __future__ import annotations

import argparse
import json
import statistics

import nbformat
import pandas as pd

from common.measure import report
from common.run.environments import ENVIRONMENTS

README_START, README_END = "<!-- bench-live:start -->", "<!-- bench-live:end -->"
WAYS = ("no monitor", "monitor", "monitor with live view")

SETUP = """
import contextlib, json, time
import torch, torchvision
from common.measure.monitor import Monitor
torch.manual_seed(0)
model = torchvision.models.densenet121(num_classes=14)
optimizer = torch.optim.Adam(model.parameters(), 1e-4)
images, labels = torch.randn({batch}, 3, {size}, {size}), (torch.rand({batch}, 14) < 0.1).float()

def step():
    optimizer.zero_grad()
    torch.nn.functional.binary_cross_entropy_with_logits(model(images), labels).backward()
    optimizer.step()

def rate(watch):
    with watch:
        start = time.perf_counter()
        for _ in range({steps}):
            step()
        return {steps} * {batch} / (time.perf_counter() - start)

step(); step()
"""
ROUND = """
found = {"no monitor": rate(contextlib.nullcontext()), "monitor": rate(Monitor(live=False)),
         "monitor with live view": rate(Monitor(live=True))}
print(json.dumps(found))
"""


def measure(rounds: int, steps: int, size: int, batch: int) -> pd.DataFrame:
    """Images/s of each way in each round, from the kernel's printed JSON."""
    from nbclient import NotebookClient

    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(SETUP.format(steps=steps, size=size, batch=batch))]
    notebook.cells += [nbformat.v4.new_code_cell(ROUND) for _ in range(rounds)]
    NotebookClient(notebook, kernel_name=ENVIRONMENTS["pytorch"].kernel, timeout=3600).execute()
    found = []
    for cell in notebook.cells[1:]:
        text = "".join(out.get("text", "") for out in cell.outputs if out.output_type == "stream")
        found.append(json.loads(text.strip().splitlines()[-1]))
    return pd.DataFrame(found, columns=list(WAYS))


def summary(rates: pd.DataFrame) -> pd.DataFrame:
    medians = {way: statistics.median(rates[way]) for way in WAYS}
    live = medians["monitor with live view"]
    return pd.DataFrame(
        {
            "images/s (median)": medians,
            "live view's cost": {way: 1 - live / medians[way] for way in WAYS[:2]},
        }
    ).rename_axis("training step")


def main(argv=None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--readme", help="also write the table into this README's bench-live block")
    args = parser.parse_args(argv)
    table = summary(measure(args.rounds, args.steps, args.size, args.batch))
    text = report.markdown(table, percent=("live view's cost",))
    print(text)
    if args.readme:
        note = report.produced_by(
            "bench-live",
            f"DenseNet-121 on the CPU, {args.size} px, batch {args.batch}, the median of {args.rounds} rounds of "
            f"{args.steps} steps each",
        )
        report.replace_block(args.readme, README_START, README_END, f"{note}\n\n{text}")
    return table


if __name__ == "__main__":
    main()
