"""The workshop guide: a 90-minute session on data vs. model parallelism on laptops without GPUs.

    python -m common.teach.workshop runs/<timestamp> [--out docs/workshop.md]   (make workshop RUN=runs/<timestamp>)

Every figure the guide quotes comes from one ``make run`` on a CPU machine: how long each notebook ran (papermill's
own timing of the executed notebook, kernel start included: what a participant waits for) and what its records
measured (the report's table, the diagnosis of each run). The guide says which machine they are from, so a teacher
can run ``make run`` on a laptop like the participants' and regenerate it.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pandas as pd

from common.measure import diagnosis, report, results
from common.run import environments

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "docs" / "workshop.md"
# The framework each participant may pick for the second data-parallel run.
OTHER_FRAMEWORKS = (
    "Tensorflow_MultiGPU",
    "Keras_TF_MultiGPU",
    "JAX_MultiGPU",
    "Keras_JAX_MultiGPU",
    "Gluon_MultiGPU",
    "Chainer_MultiGPU",
)


def run_minutes(run_dir) -> dict[tuple[str, int], float]:
    """``{(notebook, devices): minutes}`` of every notebook ``make run`` executed, from papermill's own timing."""
    found = {}
    for path in sorted(Path(run_dir, "executed").glob("*dev.ipynb")):
        name, _, count = path.stem.rpartition("-")
        seconds = json.loads(path.read_text())["metadata"].get("papermill", {}).get("duration")
        if seconds is not None:
            found[(name, int(count.removesuffix("dev")))] = seconds / 60
    return found


def machine(run_dir) -> str | None:
    """What the notebooks said they ran on (``devices.Devices.describe``), from an executed notebook's output."""
    for path in sorted(Path(run_dir, "executed").glob("*dev.ipynb")):
        found = SHARING.search(path.read_text())
        if found:
            return f"{found.group(1)} cores"
    return None


SHARING = re.compile(r"simulated CPU device\(s\) sharing (\d+) cores")


class Figures:
    """What the guide quotes, looked up in one run's records and timings; a missing one reads "–", never a guess."""

    def __init__(self, run_dir):
        self.records = results.load_all(Path(run_dir) / "results")
        self.minutes, self.cores = run_minutes(run_dir), machine(run_dir)
        self.table = report.summary_table(self.records).set_index(["notebook", "devices"])
        self.verdicts = {
            (results.label(record), record["devices"]): found for record, found in diagnosis.diagnoses(self.records)
        }

    def time(self, notebook: str, count: int) -> str:
        minutes = self.minutes.get((notebook, count))
        return f"{minutes:.1f} min" if minutes is not None else "–"

    def value(self, notebook: str, count: int, column: str, form: str) -> str:
        try:
            value = self.table.loc[(notebook, count), column]
        except KeyError:
            return "–"
        return "–" if pd.isna(value) else format(value, form)

    def verdict(self, notebook: str, count: int) -> str:
        found = self.verdicts.get((notebook, count))
        return f"*{found.verdict}* ({found.key_number})" if found else "–"

    def machine(self) -> str:
        kinds = {record["device_kind"] for record in self.records}
        day = max((record["timestamp"] for record in self.records), default="")[:10]
        where = f" on {self.cores}" if self.cores else ""
        return f"{' and '.join(sorted(kinds)) or 'no'} devices{where}, records of {day}"


def environment_needs(records: dict[str, dict | None]) -> tuple[str, str]:
    """What the session's environments take, as ``make setup`` recorded them on this machine: one sentence of disk for
    the least a participant installs (the tools and PyTorch), and a table of every environment."""
    rows, least = [], 0.0
    for name, record in records.items():
        if record is None:
            rows.append(f"| `{name}` | not installed on the machine that wrote this guide | – | – |")
            continue
        gib = record["bytes"] / 2**30
        least += gib if name in (environments.TOOLS, "pytorch") else 0.0
        notebooks = ", ".join(f"`{n}`" for n in environments.ENVIRONMENTS[name].notebooks) if name != "tools" else "–"
        rows.append(f"| `{name}` | {notebooks} | {record['seconds'] / 60:.1f} min | {gib:.1f} GB |")
    table = "\n".join(["| environment | notebooks | set-up time | disk |", "|---|---|---|---|", *rows])
    have = all(records.get(name) for name in (environments.TOOLS, "pytorch"))
    return (f"{least:.1f} GB" if have else "the disk of the tools and PyTorch environments (below)"), table


def guide(run_dir) -> str:
    """The guide's markdown, its figures from ``run_dir`` (a ``make run`` output folder), its set-up figures from this
    machine's environments."""
    f = Figures(run_dir)
    records = {name: environments.install_record(name) for name in (environments.TOOLS, *environments.ENVIRONMENTS)}
    disk, setup_table = environment_needs(records)
    opener, pt, mp = "DataParallel_From_Scratch", "PyTorch_MultiGPU", "PyTorch_ModelParallel"
    runs = f.time(opener, 2)  # the opener runs twice: as it is, then with GRADIENTS="local"
    in_ram = {way: f.value(f"{mp} ({way})", count, "ram_images_per_second", ".1f")
              for way, count in (("single-device", 1), ("naive-model-parallel", 2), ("ddp", 2))}  # fmt: skip
    pipelines = [
        (name.split("m=")[1].rstrip(")"), f.value(name, 2, "ram_images_per_second", ".1f"))
        for name, _ in f.table.index
        if name.startswith(f"{mp} (pipeline-gpipe m=")
    ]
    others = "\n".join(
        f"| `{name}` | {f.time(name, 2)} | {f.value(name, 2, 'train_images_per_second', '.1f')} | {f.verdict(name, 2)}"
        + " |"
        for name in OTHER_FRAMEWORKS
    )
    return f"""# Workshop: data vs. model parallelism on laptops without GPUs (90 minutes)

<!-- Generated by `make workshop RUN={Path(run_dir).name}` (common/teach/workshop.py) from that `make run` and the
environments `make setup` installed: edit the generator, not this file. -->

Every participant needs a laptop with Linux or WSL, Python 3.11 and {disk} free for the PyTorch notebooks, more for a
second framework (below); no GPU. The notebooks simulate
devices on the CPU (PyTorch and Chainer start one process per device, TensorFlow and Keras split the CPU into logical
devices, JAX (and Keras on it) into simulated ones, Gluon puts one model copy on each `mx.cpu(i)`), so everything below
is the real multi-device code path, only slower. The times and figures quoted come from `make run` ({f.machine()}):
regenerate the guide from a `make run` on a laptop like the participants' to quote theirs.

## Before the session

Participants clone the repository and run `make setup FRAMEWORKS="pytorch"` at home, adding the environment of the
framework they will pick at 65-80 (`FRAMEWORKS="pytorch tensorflow"` for TensorFlow or Keras, `"pytorch jax"` for JAX
or Keras on JAX, `"pytorch mxnet-chainer"` for Gluon or Chainer); then `make lab`, to check that JupyterLab opens each
notebook with its environment's kernel. What each environment took on the machine that wrote this guide (downloads
included):

{setup_table}

The teacher runs `make run` once on a laptop like theirs and `make workshop RUN=runs/<timestamp>` to put its times into
this guide.

## Schedule

| minutes | part | notebook and parameters | run time |
|---|---|---|---|
| 0-10 | data vs. model parallelism, the talk | – | – |
| 10-25 | data parallelism by hand | `{opener}`, `DEVICES=2`, then `GRADIENTS="local"` | {runs}, {runs} |
| 25-40 | data parallelism, 1 and 2 devices | `{pt}`, `DEVICES=1`, then `DEVICES=2` | {f.time(pt, 1)}, {f.time(pt, 2)} |
| 40-45 | where the time went, what held the run back | the same outputs: **Train**'s phase table, **Record** | – |
| 45-65 | model parallelism and the pipeline's bubble | `{mp}`, `DEVICES=2` | {f.time(mp, 2)} |
| 65-80 | the same data parallelism in another framework | one of the four below, `DEVICES=2` | see below |
| 80-90 | exercises, questions | the **Exercises** at the end of each notebook | – |

## 10-25: data parallelism by hand

Run `{opener}` with `DEVICES=2`. Two processes train a small network; after each backward
pass they average their gradients with `dist.all_reduce`, a dozen lines on the page. What participants should observe:

- **What one all-reduce moves**, drawn under **Model**: the gradient goes round a ring of four devices in chunks. Ask
  how the bytes each device sends change from 4 devices to 8 (hardly: 2(N-1)/N of the gradient) and what does grow
  (the number of steps, each paying the link's latency).
- **One step, four ways**: the hand-written step equals one process stepping on the whole batch and DDP's step, to
  rounding; local BatchNorm does not (each process normalizes its own share), global BatchNorm does.
- The test AUC: {f.value(opener, 2, "test_auc", ".3f")}, the copies in step ("largest difference ... from rank 0's: 0").
- Then Exercise 1 with `GRADIENTS="local"` (no all-reduce): nothing fails and the loss still falls, but the two copies
  drift apart and score differently. Ask what would have found the bug (a check across processes, as the next notebook
  makes with a fingerprint of the weights).

## 25-40: data parallelism

Run `{pt}` with `DEVICES=1` (edit the parameters cell, then Run All), then with `DEVICES=2`. While it trains, the
live view under **Train** shows the cores at work. What participants should observe:

- The global batch doubles with the devices (each keeps its batch) and the learning rate grows 1.41 times (the square
  root of 2: the scaling rule for Adam), after a warmup over the first tenth of the run.
- Training throughput: {f.value(pt, 1, "train_images_per_second", ".1f")} images/s on 1 device,
  {f.value(pt, 2, "train_images_per_second", ".1f")} on 2: a scaling efficiency of
  {f.value(pt, 2, "scaling_efficiency", ".0%")}. The two simulated devices share the same cores, so this shows the
  mechanics (two processes, one all-reduce per step), not a GPU's speed-up.
- The test AUC: {f.value(pt, 1, "test_auc", ".3f")} on 1 device, {f.value(pt, 2, "test_auc", ".3f")} on 2. Data
  parallelism changes the batch and the learning rate, not the model: ask whether the difference is larger than
  run-to-run noise (change `SEED` to find out).

## 40-45: where the time went

The phase table after **Train** and the diagnosis in **Record** ("What held this run back") answer "why is it not
twice as fast?". On the reference machine the verdicts were {f.verdict(pt, 1)} on 1 device and {f.verdict(pt, 2)} on
2. Ask the room which phase would shrink on a GPU and which would not (start-up and process launch would not).

## 45-65: model parallelism

Run `{mp}` with `DEVICES=2`. It cuts DenseNet-121 into two stages, one per device. What participants should observe
in its benchmark table (images/s of the same step on one batch in memory):

- one device alone: {in_ram["single-device"]}; naive model parallelism (one stage waits while the other computes):
  {in_ram["naive-model-parallel"]}; DDP on the same two devices: {in_ram["ddp"]}.
- the GPipe pipeline at each number of micro-batches m: {", ".join(f"m={m}: {rate}" for m, rate in pipelines) or "–"}.
  More micro-batches shrink the bubble, (p-1)/(m+p-1), until each micro-batch is too small to keep a device busy.
- the GPipe schedule drawn from the stages' measured forward and backward times, one panel per m: the blank is the
  bubble, and the lighter stage idles however many micro-batches there are. Ask why the measured step is longer than
  the drawn one at large m (the sends, and small micro-batches that use a device less well).
- Discussion: compare DDP's figure with the pipeline's. Model parallelism is for a model that does not fit one device;
  on two devices that each hold the whole model, which way used them better here?

## 65-80: another framework

Each participant picks the framework they use and runs its data-parallel notebook with `DEVICES=2`, then compares its
images/s and its diagnosis with PyTorch's (the notebooks share their headings, so the same cells are in the same
places):

| notebook | run time | training images/s | what held it back |
|---|---|---|---|
{others}

## 80-90: exercises

Each notebook ends with exercises to predict, run and compare; the hidden answer cells compute the answers from the
participant's own records. Good ones for the room: change `BATCH_SIZE_PER_DEVICE` and predict the throughput, and
set `PREPARED=False` and predict what the diagnosis's "waiting for batches" figure does.
"""


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a `make run` output folder, runs/<timestamp>")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    if not (Path(args.run_dir) / "executed").is_dir():
        raise SystemExit(f"{args.run_dir} has no executed notebooks: give a `make run` output folder, runs/<timestamp>")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results.atomic_write(out, lambda file: file.write(guide(args.run_dir)))
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
