"""Turn results records into the comparison table (markdown) and plots.

python -m common.measure.report RESULTS_DIR OUT_DIR      # report.md, throughput.png, utilization.png
python -m common.measure.report --readme README.md RUN   # copy a run's table into the README
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import math
import platform
import re
from pathlib import Path

import pandas as pd

from common.measure import diagnosis, phases, plots, results
from common.run.devices import cpu_cores

README_START, README_END = "<!-- results:start -->", "<!-- results:end -->"
PHASES_START, PHASES_END = "<!-- phases:start -->", "<!-- phases:end -->"
COLUMNS = {
    "notebook": "notebook",
    "devices": "devices",
    "device_kind": "kind",
    "precision": "precision",
    "global_batch": "global batch",
    "image_size": "image px",
    "epochs": "epochs",
    "data": "data",
    "train_images_per_second": "train img/s",
    "scaling_efficiency": "scaling",
    "ram_images_per_second": "in-RAM img/s",
    "test_auc": "test AUC",
}


# The speed-up toolboxes measure many settings of one device: their own table, not rows of the comparison.
TOOLBOXES = ("PyTorch_Speedups", "Keras_Speedups")
TOOLBOX_COLUMNS = ["technique: setting", "notebook", "device", "batch", "images/s", "first steps s", "peak MiB"]


def summary_table(records: list[dict]) -> pd.DataFrame:
    """One row per (notebook and variant, devices): the newest training run beside the newest in-RAM benchmark.

    Scaling efficiency is training throughput over ``devices`` times the
    one-device throughput of the same notebook, kind and precision (1.0 is perfect).
    """
    records = [record for record in records if record["notebook"] not in TOOLBOXES]
    if not records:
        return pd.DataFrame(columns=list(COLUMNS))
    frame = pd.DataFrame(records).assign(notebook=[results.label(r) for r in records]).sort_values("timestamp")
    key = ["notebook", "devices", "device_kind", "precision"]
    trained = frame[frame["data"] != results.IN_RAM].drop_duplicates(key, keep="last")
    in_ram = frame[frame["data"] == results.IN_RAM].drop_duplicates(key, keep="last")
    shared = ["global_batch", "image_size", "data"]  # a benchmark without a training run describes its own row
    table = trained.rename(columns={"images_per_second": "train_images_per_second"}).merge(
        in_ram[[*key, "images_per_second", *shared]].rename(
            columns={"images_per_second": "ram_images_per_second", **{name: f"ram_{name}" for name in shared}}
        ),
        on=key,
        how="outer",
    )
    for name in shared:
        table[name] = table[name].fillna(table[f"ram_{name}"]) if name in table else table[f"ram_{name}"]
    single = table[table["devices"] == 1].set_index(["notebook", "device_kind", "precision"])["train_images_per_second"]

    def efficiency(row) -> float:
        base = single.get((row["notebook"], row["device_kind"], row["precision"]))
        if base is None or not base or pd.isna(row["train_images_per_second"]):
            return math.nan
        return row["train_images_per_second"] / (row["devices"] * base)

    table["scaling_efficiency"] = table.apply(efficiency, axis=1) if len(table) else []
    for column in COLUMNS:
        if column not in table:
            table[column] = math.nan
    return table[list(COLUMNS)].sort_values(["notebook", "devices"]).reset_index(drop=True)


def to_markdown(table: pd.DataFrame) -> str:
    """A GitHub markdown table (no extra dependency), numbers rounded for reading."""

    def cell(column: str, value) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "–"
        if column in ("test_auc", "scaling_efficiency"):
            return f"{value:.3f}" if column == "test_auc" else f"{value:.0%}"
        if column.endswith("per_second"):
            return f"{value:,.1f}"
        if isinstance(value, float) and value.is_integer():
            return str(int(value))
        return str(value)

    lines = ["| " + " | ".join(COLUMNS.values()) + " |", "|" + "---|" * len(COLUMNS)]
    for _, row in table.iterrows():
        lines.append("| " + " | ".join(cell(column, row[column]) for column in COLUMNS) + " |")
    return "\n".join(lines)


def describe_devices(records: list[dict]) -> str:
    """``"gpu: NVIDIA H100 x 8"`` or ``"cpu (simulated devices sharing one machine's cores)"``."""
    parts = []
    for kind in sorted({r["device_kind"] for r in records}):
        if kind == "cpu":
            parts.append("cpu (simulated devices sharing one machine's cores)")
            continue
        widest = max((r for r in records if r["device_kind"] == kind), key=lambda r: len(r["device_names"]))
        names = pd.Series(widest["device_names"]).value_counts()
        parts.append("gpu: " + ", ".join(f"{name} x {count}" for name, count in names.items()))
    return "; ".join(parts) or "none"


def plot_throughput(table: pd.DataFrame, path: Path) -> Path:
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(9, 4))
    scaling = table[~table["notebook"].str.endswith(")")]  # placement variants are compared in their own notebooks
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for (notebook, group), colour in zip(scaling.groupby("notebook"), itertools.cycle(colours)):
        group = group.sort_values("devices")
        axis.plot(group["devices"], group["train_images_per_second"], "o-", color=colour, label=f"{notebook} (data)")
        axis.plot(group["devices"], group["ram_images_per_second"], "s--", color=colour, label=f"{notebook} (in RAM)")
    axis.set(xlabel="devices", ylabel="images / second", title="Training throughput")
    axis.set_xticks(sorted(table["devices"].dropna().unique()))
    # beside the lines, not over them
    axis.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small", frameon=False)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def plot_utilizations(records: list[dict], out_dir: Path) -> list[Path]:
    """One utilization-and-memory plot per training run that saved its samples."""
    import matplotlib.pyplot as plt

    paths = []
    for record in records:
        if record["data"] == results.IN_RAM or not record.get("utilization_csv"):
            continue
        samples = Path(record["path"]).parent / record["utilization_csv"]
        if not samples.is_file():
            continue
        title = f"{results.label(record)} on {record['devices']} device(s)"
        figure = plots.utilization(pd.read_csv(samples), title, record.get("phases"), record.get("utilization_started"))
        name = re.sub(r"[^\w.=-]+", "-", results.label(record)).strip("-")
        path = out_dir / f"utilization-{name}-{record['devices']}dev.png"
        figure.savefig(path, dpi=100)
        plt.close(figure)
        paths.append(path)
    return paths


def toolbox_table(records: list[dict]) -> pd.DataFrame:
    """The speed-up toolboxes' newest measurement of each technique and setting, a notebook after the other."""
    newest = {(r["notebook"], r["variant"]): r for r in records if r["notebook"] in TOOLBOXES}
    rows = [
        {
            "technique: setting": variant,
            "notebook": notebook,
            "device": f"{record['device_kind']} {', '.join(record['device_names'][:1])}",
            "batch": record["global_batch"],
            "images/s": round(record["images_per_second"], 1),
            "first steps s": record.get("first_steps_seconds") and round(record["first_steps_seconds"], 1),
            "peak MiB": record.get("peak_memory_mib") and round(record["peak_memory_mib"]),
        }
        for (notebook, variant), record in sorted(newest.items())
    ]
    return pd.DataFrame(rows, columns=TOOLBOX_COLUMNS).set_index("technique: setting")


def newest_runs(records: list[dict]) -> dict[tuple[str, int], dict]:
    """``{(notebook, devices): record}`` for the newest run of each, among the records that hold phases. The records of
    one notebook run (its variants, its benchmark) share its phases: the one with the most devices stands for it."""
    runs = {}
    for record in records:
        if record.get("phases"):
            run = (record["notebook"], record["phases"][0]["start"])
            runs[run] = max(runs.get(run, (0, None)), (record["devices"], record), key=lambda pair: pair[0])
    newest = {}
    for (notebook, _), (devices, record) in sorted(runs.items(), key=lambda item: item[1][1]["timestamp"]):
        newest[(notebook, devices)] = record
    return dict(sorted(newest.items()))


def phase_table(records: list[dict]) -> pd.DataFrame:
    """Seconds per phase of the newest run of each notebook and device count (:func:`newest_runs`), and the share of
    the run spent in training steps."""
    rows = {}
    for (notebook, devices), record in newest_runs(records).items():
        table = phases.table(record["phases"])
        row = table["seconds"].to_dict()
        row["steps share"] = phases.steps_share(record["phases"])
        rows[f"{notebook} ({devices} dev)"] = row
    columns = [name for name in [*phases.ORDER, phases.BETWEEN] if any(name in row for row in rows.values())]
    return pd.DataFrame.from_dict(rows, orient="index").reindex(columns=[*columns, "steps share"])


def markdown(table: pd.DataFrame, percent=()) -> str:
    """A table as GitHub markdown, its index first: numbers rounded for reading, the ``percent`` columns as shares."""

    def cell(column, value) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "–"
        if column in percent:
            return f"{value:.0%}"
        return f"{value:,.1f}" if isinstance(value, float) else str(value)

    lines = [f"| {table.index.name or ''} | " + " | ".join(table.columns) + " |", "|---|" + "---|" * len(table.columns)]
    for name, row in table.iterrows():
        lines.append(f"| {name} | " + " | ".join(cell(column, value) for column, value in row.items()) + " |")
    return "\n".join(lines)


def plot_phases(table: pd.DataFrame, path: Path) -> Path:
    """One stacked bar per run: where its wall-clock seconds went, phase by phase."""
    import matplotlib.pyplot as plt

    seconds = table.drop(columns="steps share").fillna(0.0).iloc[::-1]
    figure, axis = plt.subplots(figsize=(9, 0.4 * len(seconds) + 1.5))
    left = pd.Series(0.0, index=seconds.index)
    for name in seconds.columns:
        axis.barh(seconds.index, seconds[name], left=left, color=plots.PHASE_COLOURS[name], label=name)
        left += seconds[name]
    axis.set(xlabel="seconds (wall clock)", title="Where each notebook run's time went")
    axis.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small", frameon=False)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def build(results_dir, out_dir) -> Path:
    """Write ``report.md`` and its plots into ``out_dir``; returns the report's path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    records = results.load_all(results_dir)
    table = summary_table(records)
    newest = {(results.label(r), r["devices"]): r for r in records if r["data"] != results.IN_RAM}
    lines = [
        "# Results",
        "",
        f"{len(records)} record(s) from `{results_dir}`; devices: {describe_devices(records)}.",
        "",
        table_section(table),
        "",
    ]
    if len(table):
        lines += [f"![throughput]({plot_throughput(table, out_dir / 'throughput.png').name})", ""]
    toolbox = toolbox_table(records)
    if len(toolbox):
        lines += ["## The speed-up toolbox", "", markdown(toolbox), ""]
    diagnosed = diagnosis.table(records)
    if len(diagnosed):
        lines += ["## What held each run back", "", markdown(diagnosed.set_index("notebook")), "", diagnosis.NOTE, ""]
    spent = phase_table(records)
    if len(spent):
        lines += ["## Where the time went", "", phases_section(spent), ""]
        lines += [f"![phases]({plot_phases(spent, out_dir / 'phases.png').name})", ""]
    for path in plot_utilizations(list(newest.values()), out_dir):
        lines += [f"![{path.stem}]({path.name})", ""]
    report = out_dir / "report.md"
    results.atomic_write(report, lambda file: file.write("\n".join(lines)))
    return report


def table_section(table: pd.DataFrame) -> str:
    return (
        to_markdown(table)
        + "\n\n*train img/s*: training on the data set, first epoch left out; *in-RAM img/s*: the same step on one"
        " random batch held in device memory; *scaling*: train img/s over devices x the one-device figure."
    )


def phases_section(table: pd.DataFrame) -> str:
    return (
        markdown(table.rename_axis("run"), percent=("steps share",))
        + "\n\nSeconds of each phase (`common.measure.phases`: repeated phases summed over the epochs); *steps share*: "
        "the steady steps' (train and benchmark) share of the run's span, the part that uses the devices for what the"
        " run is for; the diagnosis' *outside the steps* is the timed rest, without the time between phases."
    )


def update_readme(readme, run_dir) -> None:
    """Replace the README's results block with the table of the records in ``run_dir/results``."""
    run_dir = Path(run_dir)
    records = results.load_all(run_dir / "results")
    if not records:
        raise SystemExit(f"{run_dir / 'results'} holds no results records: run `make run` first")
    day = max(r["timestamp"] for r in records)[:10]
    note = f"Produced by `make run` on {day} (run `{run_dir.name}`); devices: {describe_devices(records)}."
    replace_block(readme, README_START, README_END, f"{note}\n\n{table_section(summary_table(records))}")
    spent = phase_table(records)
    if len(spent):
        replace_block(readme, PHASES_START, PHASES_END, f"From `make run` `{run_dir.name}`:\n\n{phases_section(spent)}")


def produced_by(target: str, details: str = "") -> str:
    """The line above a benchmark's figures in a README: which ``make`` target made them, when and on what machine."""
    machine = f"{platform.processor() or platform.machine()}, {cpu_cores()} cores"
    return f"Produced by `make {target}` on {dt.date.today()} ({machine}{f'; {details}' if details else ''}):"


def replace_block(path, start: str, end: str, content: str) -> None:
    """Replace what lies between the ``start`` and ``end`` markers of a text file."""
    path = Path(path)
    text = path.read_text()
    if start not in text or end not in text:
        raise SystemExit(f"{path} has no {start} ... {end} block to replace")
    block = f"{start}\n{content}\n{end}"
    replaced = re.sub(re.escape(start) + ".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    results.atomic_write(path, lambda file: file.write(replaced))


SETUP_START, SETUP_END = "<!-- setup:start -->", "<!-- setup:end -->"


def setup_table(records: dict[str, dict | None]) -> str:
    """The set-up time and disk of each environment as ``make setup`` recorded them (``install_record``), and the
    whole set-up's: the environments install side by side, so its time is the wall time from the first start to the
    last end. An environment that is not installed is named as such."""
    rows, installed = [], {name: record for name, record in records.items() if record}
    for name, record in records.items():
        if record is None:
            rows.append(f"| {name} | not installed | – | – |")
            continue
        size = record["bytes"] / 2**30
        rows.append(f"| {name} | {record['build']} | {record['seconds'] / 60:.1f} min | {size:.1f} GB |")
    starts = [record["started"] for record in installed.values()]
    ends = [record["started"] + record["seconds"] for record in installed.values()]
    wall = (max(ends) - min(starts)) / 60 if installed else 0.0
    disk = sum(record["bytes"] for record in installed.values()) / 2**30
    dates = sorted({record["date"] for record in installed.values()})
    cores = sorted({record["cores"] for record in installed.values()})
    cache = max((record.get("pip_cache_bytes", 0) for record in installed.values()), default=0) / 2**20
    note = (
        f"Recorded by `make setup` on {', '.join(dates)} ({'/'.join(map(str, cores))} cores), each environment built "
        f"into an empty folder, with {cache:,.0f} MB in pip's cache at the start; the environments install side by "
        "side, so the total is the wall time of the whole set-up (`make readme-setup` writes this table):"
    )
    return "\n".join(
        [note, "", "| environment | build | set-up time | disk |", "|---|---|---|---|", *rows,
         f"| **make setup** | | {wall:.1f} min | {disk:.1f} GB |"]
    )  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--readme", help="update this README from the run folder given as first argument")
    parser.add_argument("--setup", action="store_true", help="with --readme: the environments' set-up table only")
    parser.add_argument("source", nargs="?", help="results folder (with --readme: a run folder holding results/)")
    parser.add_argument("out", nargs="?", help="output folder (default: the results folder's parent)")
    args = parser.parse_args(argv)
    if args.setup:
        from common.run.environments import ENVIRONMENTS, TOOLS, install_record

        records = {name: install_record(name) for name in (TOOLS, *ENVIRONMENTS)}
        replace_block(args.readme, SETUP_START, SETUP_END, setup_table(records))
        print(f"updated the set-up table of {args.readme}")
        return
    if args.readme:
        update_readme(args.readme, args.source)
        print(f"updated {args.readme} from {args.source}")
        return
    print(build(args.source, args.out or Path(args.source).parent))


if __name__ == "__main__":
    main()
