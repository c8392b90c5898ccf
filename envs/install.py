"""Build the environments: one per framework family, each from its own lock, each with its own Jupyter kernel.

    python3.11 envs/install.py                         # every environment (what `make setup` runs)
    python3.11 envs/install.py pytorch                 # the tools and the PyTorch environment only
    python3.11 envs/install.py --gpu 1 --driver 535.104.05 --dry-run   # what a GPU box with that driver would get

One environment cannot hold every framework on a GPU box: PyPI's torch is a CUDA 13 build, TensorFlow's CUDA
packages are CUDA 12 ones that own the very same files (``nvidia/nccl/lib/libnccl.so.2``, ...), and MXNet and Chainer
need numpy 1.x. So each family gets ``.venvs/<environment>``:

- ``tools``: JupyterLab, papermill, nbval, pytest and the report, no framework. It starts every other environment's
  kernel (their kernelspecs are installed into it) and runs the framework-neutral tests.
- ``pytorch``, ``tensorflow`` (with Keras) and ``mxnet-chainer`` (the two retired frameworks, numpy 1.26, MPI).

Each installs its lock with ``pip --no-deps`` (every package pinned: two installs are the same), then ``common/``
as an editable package, then registers its kernel. An environment whose lock, build and ``pyproject.toml`` have not
changed since its last install is skipped. Standard library only: this runs before any environment exists.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import datetime
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
from common.run.environments import ENVIRONMENTS as FRAMEWORK_ENVIRONMENTS  # noqa: E402 (standard library only)
from common.run.environments import MIN_DRIVER, STAMP, TOOLS, VENVS, install_record  # noqa: E402

PIP = "pip==26.3"
FRAMEWORKS = tuple(FRAMEWORK_ENVIRONMENTS)
ENVIRONMENTS = (TOOLS, *FRAMEWORKS)

# The CUDA builds each environment has, newest first.
GPU_BUILDS = {"tools": (), "pytorch": (13, 12), "tensorflow": (12,), "mxnet-chainer": (11,), "jax": (13,)}
# PyPI's torch is the CUDA 13 build, for CPUs as well (PyPI has no CPU-only torch for Linux x86_64).
CPU_BUILD = {"tools": "cpu", "pytorch": "cuda13", "tensorflow": "cpu", "mxnet-chainer": "cpu", "jax": "cpu"}
# Where the CUDA 12 builds of torch and torchvision come from (PyPI has only the CUDA 13 ones); the tag of the
# index's name (cu126) is the local version of the wheels it serves (torch==2.14.1+cu126).
TORCH_CUDA12_INDEX = os.environ.get("TORCH_CUDA12_INDEX", "https://download.pytorch.org/whl/cu126")
TORCH_PACKAGES = ("torch", "torchvision")


class SetupError(Exception):
    """What cannot be installed here, and what to do instead."""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_file(environment: str, build: str) -> Path:
    """The lock a build installs; PyTorch's CUDA 12 build is its CUDA 13 lock with torch from another index."""
    return HERE / environment / f"{'cuda13' if build == 'cuda12' and environment == 'pytorch' else build}.txt"


def parse_driver(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.strip().split("."))


def installed_driver() -> str | None:
    """The NVIDIA driver version that ``nvidia-smi`` reports, or None without a GPU (or without nvidia-smi)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.split()
    return lines[0] if out.returncode == 0 and lines else None


def choose_build(environment: str, gpu: bool, driver: str | None) -> str:
    """``cpu``/``cudaNN``: the newest build of ``environment`` that this machine's driver runs."""
    if not gpu or not GPU_BUILDS[environment]:
        return CPU_BUILD[environment]
    if driver is None:  # GPU=1 without a driver to ask (a Docker build): the newest build
        return f"cuda{GPU_BUILDS[environment][0]}"
    for major in GPU_BUILDS[environment]:
        if parse_driver(driver) >= parse_driver(MIN_DRIVER[major]):
            return f"cuda{major}"
    oldest = GPU_BUILDS[environment][-1]
    raise SetupError(
        f"The NVIDIA driver here is {driver}; the oldest CUDA build of the {environment} environment (CUDA {oldest}) "
        f"needs {MIN_DRIVER[oldest]} or newer. Update the driver, or install the CPU build (make setup GPU=0) to run "
        "the notebooks on simulated CPU devices."
    )


@dataclass
class Plan:
    environment: str
    build: str
    commands: list[list[str]]
    digest: str  # of the commands, the lock and pyproject.toml: what makes an installed environment this one

    @property
    def python(self) -> Path:
        return VENVS / self.environment / "bin" / "python"

    @property
    def done(self) -> bool:
        return self.python.exists() and (install_record(self.environment) or {}).get("digest") == self.digest


def plan(environment: str, gpu: bool, driver: str | None, python: str = sys.executable) -> Plan:
    build = choose_build(environment, gpu, driver)
    lock = lock_file(environment, build)
    venv = VENVS / environment
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check"]
    commands = [[python, "-m", "venv", "--clear", str(venv)], pip + ["--quiet", PIP]]
    installs = [
        pip + ["--no-deps", "--build-constraint", str(HERE / "build-constraints.txt"), "-r", str(lock)],
        pip + ["--no-deps", "--no-build-isolation", "--quiet", "-e", str(ROOT)],
    ]
    if build == "cuda12" and environment == "pytorch":
        tag = TORCH_CUDA12_INDEX.rstrip("/").rsplit("/", 1)[-1]
        rest = [line for line in lock.read_text().splitlines() if line and not line.startswith("#")]
        cuda13 = [pin for pin in rest if re.match(r"(torch|torchvision|triton|nvidia-(?!ml-py)|cuda-)", pin)]
        torch_pins = [f"{pin}+{tag}" for pin in cuda13 if pin.split("==")[0] in TORCH_PACKAGES]
        # torch pins its own CUDA libraries (nvidia-*==...) in its metadata: with deps, its index's build brings
        # exactly those; everything else stays at the lock's versions
        installs[0] = pip + ["--no-deps", *[pin for pin in rest if pin not in cuda13]]
        installs.insert(1, pip + ["--extra-index-url", TORCH_CUDA12_INDEX, *torch_pins])
    commands += installs
    digest = hashlib.sha256(json.dumps(commands).encode())
    for path in (lock, ROOT / "pyproject.toml"):
        digest.update(path.read_bytes())
    return Plan(environment, build, commands, digest.hexdigest())


def disk_bytes(folder: Path) -> int:
    """Bytes on disk under ``folder`` (allocated blocks, as ``du`` counts them; hard links once)."""
    seen, total = set(), 0
    for path in folder.rglob("*"):
        stat = path.lstat()
        if (stat.st_dev, stat.st_ino) not in seen:
            seen.add((stat.st_dev, stat.st_ino))
            total += stat.st_blocks * 512
    return total


def register_kernel(environment: str) -> None:
    """Install ``environment``'s kernelspec into the tools environment, where JupyterLab and papermill look, unless
    it is there already and names this environment's Python (a rebuilt tools environment has none)."""
    python = VENVS / environment / "bin" / "python"
    spec = VENVS / "tools" / "share" / "jupyter" / "kernels" / f"multigpu-{environment}" / "kernel.json"
    if spec.exists() and json.loads(spec.read_text())["argv"][0] == str(python):
        return
    command = [str(python), "-m", "common.run.kernel", "--environment", environment, "--prefix", str(VENVS / "tools")]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=ROOT)


def site_packages(environment: str) -> Path:
    return next((VENVS / environment / "lib").glob("python3*/site-packages"))


def shared_files(site: Path) -> dict[str, list[str]]:
    """Files of ``site`` that two or more installed distributions own (by their RECORD files): ``{path: [names]}``.

    pip installs a second distribution's copy of a file over the first one's without a word, so two CUDA stacks in
    one environment (torch's nvidia-nccl-cu13 and TensorFlow's nvidia-nccl-cu12 both own
    ``nvidia/nccl/lib/libnccl.so.2``) would leave one framework on the other's libraries.
    """
    owners: dict[str, set[str]] = {}
    for record in site.glob("*.dist-info/RECORD"):
        name = record.parent.name.split("-")[0]
        for row in csv.reader(record.read_text().splitlines()):
            if row:
                owners.setdefault(row[0], set()).add(name)
    return {path: sorted(names) for path, names in owners.items() if len(names) > 1}


def pip_cache_bytes() -> int:
    """What pip's cache holds now (a fresh machine's is empty): set-up times mean little without it."""
    folder = os.environ.get("PIP_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pip"
    return disk_bytes(Path(folder)) if Path(folder).is_dir() else 0


def run(plan: Plan, cache: int = 0) -> None:
    """Install ``plan``'s environment, its commands' output in ``.venvs/<environment>.log``, and record what it took
    (see :func:`common.run.environments.install_record`)."""
    started = time.time()
    log_path = VENVS / f"{plan.environment}.log"
    VENVS.mkdir(exist_ok=True)
    with log_path.open("w") as log:
        for command in plan.commands:
            log.write(f"+ {' '.join(command)}\n")
            log.flush()
            done = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            if done.returncode != 0:
                tail = "".join(log_path.read_text().splitlines(keepends=True)[-30:])
                raise SetupError(f"installing the {plan.environment} environment failed ({log_path}):\n{tail}")
    shared = shared_files(site_packages(plan.environment))
    if shared:
        listed = "\n  ".join(f"{path}: {', '.join(names)}" for path, names in sorted(shared.items())[:20])
        raise SetupError(
            f"In the {plan.environment} environment, {len(shared)} file(s) belong to two distributions, so one "
            f"overwrote the other's:\n  {listed}\nThe lock {lock_file(plan.environment, plan.build).name} mixes two "
            "builds (two CUDA versions?): fix its .in file and run make lock."
        )
    record = {
        "build": plan.build,
        "digest": plan.digest,
        "started": round(started, 1),
        "seconds": round(time.time() - started, 1),
        "bytes": disk_bytes(VENVS / plan.environment),
        "date": datetime.date.today().isoformat(),
        "cores": len(os.sched_getaffinity(0)),
        "pip_cache_bytes": cache,
    }
    (VENVS / plan.environment / STAMP).write_text(json.dumps(record) + "\n")
    print(f"{plan.environment}: installed in {record['seconds']:.0f} s, {record['bytes'] / 2**30:.1f} GB", flush=True)


def run_all(plans: list[Plan]) -> list[str]:
    """Install every plan at once: downloading, unpacking and writing gigabytes wait on the network and the disk more
    than on the cores. Returns the errors of those that failed."""
    if not plans:
        return []
    cache = pip_cache_bytes()
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(plans))) as pool:
        futures = {pool.submit(run, step, cache): step for step in plans}
        print(f"installing {', '.join(step.environment for step in plans)} side by side (logs: {VENVS}/<name>.log)")
        errors = []
        for future in concurrent.futures.as_completed(futures):
            try:
                future.result()
            except SetupError as error:
                errors.append(str(error))
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("frameworks", nargs="*", help=f"of {', '.join(FRAMEWORKS)} (default: all)")
    parser.add_argument(
        "--gpu", choices=("auto", "0", "1"), default="auto", help="auto: GPU builds when nvidia-smi lists a GPU"
    )
    parser.add_argument("--driver", help="the NVIDIA driver version to plan for (default: what nvidia-smi says)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, install nothing")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.frameworks) - set(FRAMEWORKS))
    if unknown:
        parser.error(f"unknown framework environment(s) {', '.join(unknown)}: choose from {' '.join(FRAMEWORKS)}")
    if sys.version_info[:2] != (3, 11):
        print(f"envs/install.py: the locks are made for Python 3.11, this is {sys.version.split()[0]}: "
              "run it with python3.11 (make setup PYTHON=python3.11).", file=sys.stderr)  # fmt: skip
        return 2
    driver = args.driver or installed_driver()
    gpu = driver is not None if args.gpu == "auto" else args.gpu == "1"
    wanted = ["tools", *[name for name in FRAMEWORKS if name in (args.frameworks or FRAMEWORKS)]]
    try:
        plans = [plan(name, gpu, driver) for name in wanted]
    except SetupError as error:
        print(f"envs/install.py: {error}", file=sys.stderr)
        return 1
    machine = f"GPU machine (driver {driver})" if gpu and driver else "GPU machine" if gpu else "CPU machine"
    for step in plans:
        state = "installed" if step.done else "to install"
        source = lock_file(step.environment, step.build).relative_to(ROOT)
        if step.build == "cuda12" and step.environment == "pytorch":
            source = f"{source} with torch from {TORCH_CUDA12_INDEX}"
        print(f"{step.environment}: {step.build} build ({source}) for this {machine}, {state}", flush=True)
        if args.dry_run:
            for command in step.commands:
                print("   ", " ".join(command))
    if args.dry_run:
        return 0
    errors = run_all([step for step in plans if not step.done])
    for error in errors:
        print(f"envs/install.py: {error}", file=sys.stderr)
    if errors:
        return 1
    for step in plans[1:]:
        register_kernel(step.environment)
    return 0


if __name__ == "__main__":
    sys.exit(main())
