"""Execute every notebook headless with papermill on 1 and N devices, then build the report.

    python -m common.run                          # generated data, all notebooks, 1 and N devices
    python -m common.run --data-dir /data/chestxray14 --devices 1 2 4
    python -m common.run --notebooks PyTorch_MultiGPU -p EPOCHS 1
    python -m common.run --list                   # which notebooks can run here, which not and why

Everything lands in ``runs/<timestamp>/``: executed notebooks, results JSON, report.md and plots.
"""

from __future__ import annotations

import argparse
import ast
import datetime as dt
import sys
import time
from pathlib import Path

from common.data import synthetic
from common.errors import InputError
from common.measure import report
from common.run import devices, environments, params

NOTEBOOK_DIR = Path(__file__).resolve().parents[2] / "notebooks"
# These compare ways of placing the model, or of training faster, inside one run: they run once, on the most devices
# (at least this many); at fewer devices there is nothing to compare, and one device would repeat PyTorch_MultiGPU.
COMPARES_PLACEMENTS = {
    "PyTorch_MultiGPU-Exp-Loss": 1,
    "PyTorch_ModelParallel": 2,
    "PyTorch_Speedups": 1,
    "Keras_Speedups": 1,
}


def device_counts(hardware: devices.Devices) -> list[int]:
    """One device and all of them (two simulated devices without a GPU)."""
    most = hardware.available if hardware.kind == "gpu" else min(2, hardware.available)
    return sorted({1, most})


def counts_for(notebook: str, counts: list[int]) -> list[int]:
    """The device counts ``notebook`` runs at: all of them, or only the most for a notebook that compares placements."""
    if notebook not in COMPARES_PLACEMENTS:
        return counts
    most = max(counts)
    return [most] if most >= COMPARES_PLACEMENTS[notebook] else []


def installed_kernels() -> set[str]:
    """The kernels Jupyter finds from here (the tools environment holds every environment's after ``make setup``)."""
    from jupyter_client.kernelspec import KernelSpecManager

    return set(KernelSpecManager().find_kernel_specs())


def runnable(notebooks: list[Path], kernels: set[str]) -> tuple[list[Path], list[str]]:
    """The notebooks whose environment's kernel is installed, and one line for each that is not, saying why."""
    missing = {}
    for notebook in notebooks:
        env = environments.for_notebook(notebook.stem)
        if env.kernel not in kernels:
            missing.setdefault(env.name, []).append(notebook.stem)
    skipped = [
        f"{', '.join(names)}: skipped, the {name} environment is not installed (no kernel "
        f"{environments.ENVIRONMENTS[name].kernel}): {environments.setup_command(name)}"
        for name, names in missing.items()
    ]
    kept = [notebook for notebook in notebooks if environments.for_notebook(notebook.stem).name not in missing]
    return kept, skipped


def parse_value(text: str):
    """``-p EPOCHS 2`` -> 2, ``-p PRECISION mixed`` -> "mixed", ``-p MAX_IMAGES None`` -> None."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def find_notebooks(names: list[str] | None, folder: Path = NOTEBOOK_DIR) -> list[Path]:
    available = sorted(folder.glob("*.ipynb"))
    if not names:
        return available
    by_name = {path.stem: path for path in available}
    unknown = [name for name in names if name not in by_name]
    if unknown:
        raise InputError(f"No notebook named {', '.join(unknown)} in {folder}: choose among {', '.join(by_name)}.")
    return [by_name[name] for name in names]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", help="a ChestX-ray14 folder (default: generate the stand-in data set)")
    parser.add_argument("--notebooks", nargs="*", help="notebook names without .ipynb (default: all)")
    parser.add_argument("--devices", nargs="*", type=int, help="device counts (default: 1 and all)")
    parser.add_argument("--global-batch", type=int, help="keep this global batch at every device count")
    parser.add_argument("--out", help="output folder (default: runs/<timestamp>)")
    parser.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"))
    parser.add_argument(
        "--list", action="store_true", help="say which notebooks can run here (their kernels), and stop"
    )
    args = parser.parse_args(argv)
    if args.list:
        kept, skipped = runnable(find_notebooks(args.notebooks), installed_kernels())
        for notebook in kept:
            print(f"{notebook.stem}: kernel {environments.for_notebook(notebook.stem).kernel}")
        print("\n".join(skipped))
        return 0

    import papermill  # imported late: `--help` and argument errors stay instant

    hardware = devices.resolve(None)
    counts = args.devices or device_counts(hardware)
    for count in counts:  # every count is checked before the first notebook starts
        devices.resolve(count)
    extra = {name: parse_value(value) for name, value in args.parameter}
    batches = (
        {count: params.per_device_batch(args.global_batch, count) for count in counts} if args.global_batch else {}
    )
    notebooks, skipped = runnable(find_notebooks(args.notebooks), installed_kernels())
    for line in skipped:
        print(line)
    out = Path(args.out or Path("runs") / dt.datetime.now().strftime("%Y%m%d-%H%M%S")).resolve()
    data_dir = Path(args.data_dir) if args.data_dir else synthetic.ensure(**synthetic.STANDIN[hardware.kind])
    print(f"{hardware.kind} machine, device counts {counts}; data: {data_dir}; output: {out}")

    failures = []
    for notebook in notebooks:
        if not counts_for(notebook.stem, counts):
            print(f"{notebook.stem}: skipped, it needs {COMPARES_PLACEMENTS[notebook.stem]} or more devices")
        for count in counts_for(notebook.stem, counts):
            executed = out / "executed" / f"{notebook.stem}-{count}dev.ipynb"
            executed.parent.mkdir(parents=True, exist_ok=True)
            parameters = {"DATA_DIR": str(data_dir), "DEVICES": count, "RESULTS_DIR": str(out / "results"), **extra}
            if count in batches:
                parameters["BATCH_SIZE_PER_DEVICE"] = batches[count]
            start = time.perf_counter()
            print(f"{notebook.stem} on {count} device(s) ...", flush=True)
            try:
                papermill.execute_notebook(
                    notebook,
                    executed,
                    parameters=parameters,
                    kernel_name=environments.for_notebook(notebook.stem).kernel,
                    cwd=notebook.parent,
                    progress_bar=False,
                    # the kernel warns on every start that it listens on localhost TCP: papermill's own transport
                    extra_arguments=["--IPKernelApp.log_level=ERROR"],
                )
            except papermill.PapermillExecutionError as error:
                failures.append(f"{executed}: {error.ename}: {error.evalue}")
                print(f"  FAILED after {time.perf_counter() - start:.0f} s: {error.ename}: {error.evalue}")
                continue
            print(f"  done in {time.perf_counter() - start:.0f} s -> {executed}")

    if (out / "results").is_dir():
        print(f"report: {report.build(out / 'results', out)}")
    if failures:
        print("failed notebooks:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except InputError as error:
        sys.exit(f"error: {error}")
