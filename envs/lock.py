"""Write the locks: every ``envs/<environment>/<build>.in`` resolved by pip into ``<build>.txt``, every package of it
pinned with ``==``, and each environment's ``environment.yml`` from the lock it installs on a CPU.

    make lock                              # all of them (needs pip 25.3 or newer: the tools environment has it)
    python envs/lock.py tensorflow/cuda12  # one

pip resolves for the Python that runs this script, on this platform: Linux x86_64, CPython 3.11, the one the pins are
made for. Nothing is installed (``pip install --dry-run --report``), so a GPU build's lock is written on a CPU machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import install  # noqa: E402  (beside this file, not a package)

HEADER = """\
# The lock of {name}: every package this environment installs, pinned.
# Written by `make lock` from {source}: edit that file, not this one. `make setup` installs exactly this list.
"""


def resolve(source: Path) -> dict[str, str]:
    """``{name: version}`` of everything pip would install for ``source`` into an empty environment."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
             "--disable-pip-version-check", "--report", str(report),
             "--build-constraint", str(HERE / "build-constraints.txt"), "-r", str(source)],
            check=True, cwd=source.parent,
        )  # fmt: skip
        resolved = json.loads(report.read_text())["install"]
    return {install.canonical(item["metadata"]["name"]): item["metadata"]["version"] for item in resolved}


def write_lock(source: Path) -> Path:
    pins = resolve(source)
    lock = source.with_suffix(".txt")
    lines = [f"{name}=={version}\n" for name, version in sorted(pins.items())]
    relative = source.relative_to(HERE.parent)
    lock.write_text(HEADER.format(name=f"{source.parent.name} ({source.stem})", source=relative) + "".join(lines))
    return lock


def write_environment_yml(environment: str) -> Path:
    """conda's route to the same environment: Python 3.11 and the CPU lock as its pip list."""
    lock = install.lock_file(environment, install.CPU_BUILD[environment])
    pins = [line for line in lock.read_text().splitlines() if line and not line.startswith("#")]
    target = HERE / environment / "environment.yml"
    kernel = "" if environment == "tools" else f" && python -m common.run.kernel --environment {environment} --user"
    target.write_text(
        f"# conda's route to the {environment} environment on a CPU machine: Python 3.11 and exactly the pins of\n"
        f"# {lock.relative_to(HERE.parent)} (a test keeps the two equal; GPU machines use `make setup`).\n"
        f"#   PIP_BUILD_CONSTRAINT=envs/build-constraints.txt conda env create -f {target.relative_to(HERE.parent)}\n"
        f"#   conda activate multigpu-{environment} && pip install --no-deps -e .{kernel}\n"
        f"name: multigpu-{environment}\n"
        "channels:\n  - conda-forge\ndependencies:\n  - python=3.11\n  - pip\n  - pip:\n"
        + "".join(f"      - {pin}\n" for pin in pins)
    )
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sources", nargs="*", help="environment/build, e.g. tensorflow/cuda12 (default: all)")
    args = parser.parse_args(argv)
    sources = [HERE / f"{name}.in" for name in args.sources] or sorted(HERE.glob("*/*.in"))
    for source in sources:
        print(f"{source.relative_to(HERE.parent)} -> {write_lock(source).relative_to(HERE.parent)}", flush=True)
    for environment in sorted({source.parent.name for source in sources}):
        print(f"  {write_environment_yml(environment).relative_to(HERE.parent)}")


if __name__ == "__main__":
    main()
