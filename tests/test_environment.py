"""One environment per framework family: each installs exactly its lock, no two distributions in one own the same
file, every kernel is registered where JupyterLab looks, and `common` reads as its architecture, with no import circle.
"""

import ast
import re
import subprocess
import sys
from importlib.metadata import distributions
from pathlib import Path

import pytest
import yaml

from common.run.environments import ENVIRONMENTS, TOOLS

ROOT = Path(__file__).parent.parent
ENVS = ROOT / "envs"
sys.path.insert(0, str(ENVS))
import install  # noqa: E402 (envs/install.py: make setup's engine, standard library only)

LOCKS = sorted(ENVS.glob("*/*.txt"))
INSTALLED = [name for name in install.ENVIRONMENTS if install.install_record(name)]
PIN = re.compile(r"([a-z0-9][a-z0-9.\-]*)==([0-9][0-9A-Za-z.+\-]*)")


def pins(path: Path) -> dict[str, str]:
    """``{name: version}`` of a requirements file, following ``-r`` includes; every requirement must be ``==``."""
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        if line.startswith("-r "):
            found.update(pins(path.parent / line[3:]))
            continue
        match = PIN.fullmatch(re.sub(r"\[[a-z0-9\-,]+\]", "", line.lower()))
        assert match, f"{path.relative_to(ROOT)}: {line!r} is not pinned with =="
        found[install.canonical(match.group(1))] = match.group(2)
    return found


@pytest.mark.parametrize("lock", LOCKS, ids=lambda path: f"{path.parent.name}/{path.name}")
def test_every_lock_pins_everything_its_source_asks_for(lock):
    locked, asked = pins(lock), pins(lock.with_suffix(".in"))
    assert len(locked) > len(asked), "a lock holds the whole tree, not only what was asked for"
    for name, version in asked.items():
        assert locked.get(name) == version, f"{lock.name} has {name}=={locked.get(name)}, its source asks {version}"


def cuda_majors(locked: dict[str, str]) -> set[int]:
    """The CUDA major versions a lock's packages are built for (their names say it, or cuda-toolkit's version)."""
    majors = set()
    for name, version in locked.items():
        if match := re.fullmatch(r"(?:nvidia-.*-cu|cupy-cuda|mxnet-cu)(\d\d)\d?x?", name):
            majors.add(int(match.group(1)))
        elif name in ("cuda-toolkit", "cuda-bindings"):
            majors.add(int(version.split(".")[0]))
    return majors


@pytest.mark.parametrize("lock", LOCKS, ids=lambda path: f"{path.parent.name}/{path.name}")
def test_within_one_environment_the_gpu_packages_use_one_cuda_major_version(lock):
    majors, build = cuda_majors(pins(lock)), lock.stem
    if build == "cpu":
        assert majors == set(), f"a CPU lock with CUDA packages: {majors}"
    else:
        assert majors == {int(build.removeprefix("cuda"))}, f"{lock.name} holds CUDA {sorted(majors)}"


def test_the_cuda_major_of_a_lock_is_read_right():
    assert cuda_majors({"nvidia-nccl-cu12": "2.2", "nvidia-cudnn-cu13": "9.1"}) == {12, 13}
    assert cuda_majors({"mxnet-cu112": "1.9.1", "cupy-cuda11x": "13.6.0", "cuda-toolkit": "13.0.3"}) == {11, 13}
    assert cuda_majors({"nvidia-ml-py": "13.615.71", "numpy": "2.4.6"}) == set()


def test_pytorch_and_tensorflow_have_numpy_2_the_retired_frameworks_numpy_1_26():
    for lock in LOCKS:
        numpy = pins(lock)["numpy"]
        expected = "1.26." if lock.parent.name == "mxnet-chainer" else "2."
        assert numpy.startswith(expected), f"{lock.relative_to(ROOT)}: numpy {numpy}"


def test_each_environment_builds_from_its_own_locks_with_the_newest_frameworks_they_allow():
    builds = {lock.parent.name: lock.stem for lock in LOCKS}
    assert set(builds) == set(install.ENVIRONMENTS)
    assert pins(ENVS / "pytorch" / "cuda13.txt")["torch"] == "2.14.1"
    assert (
        pins(ENVS / "tensorflow" / "cuda12.txt")["tensorflow"]
        == pins(ENVS / "tensorflow" / "cpu.txt")["tensorflow-cpu"]
    )
    legacy = pins(ENVS / "mxnet-chainer" / "cuda11.txt")
    assert legacy["mxnet-cu112"] == pins(ENVS / "mxnet-chainer" / "cpu.txt")["mxnet"] == "1.9.1"
    for framework in ("torch", "tensorflow", "tensorflow-cpu", "mxnet", "chainer", "jax"):
        holders = [lock.parent.name for lock in LOCKS if framework in pins(lock)]
        assert len(set(holders)) <= 1, f"{framework} is in more than one environment: {holders}"
    # Keras on both of its backends, the one version: the two Keras notebooks differ in the backend only
    keras = {f"{lock.parent.name}/{lock.stem}": pins(lock).get("keras") for lock in LOCKS}
    assert {found for found in keras.values() if found} == {pins(ENVS / "tensorflow" / "cpu.txt")["keras"]}, keras
    assert {name.split("/")[0] for name, found in keras.items() if found} == {"tensorflow", "jax"}, keras


@pytest.mark.parametrize("environment", install.ENVIRONMENTS)
def test_environment_yml_is_the_cpu_lock(environment):
    text = (ENVS / environment / "environment.yml").read_text()
    conda = yaml.safe_load(text)
    assert "python=3.11" in conda["dependencies"] and conda["name"] == f"multigpu-{environment}"
    pip_list = next(item["pip"] for item in conda["dependencies"] if isinstance(item, dict))
    from_yml = {install.canonical(line.split("==")[0]): line.split("==")[1] for line in pip_list}
    assert from_yml == pins(install.lock_file(environment, install.CPU_BUILD[environment]))


# ---------------------------------------------------------------- what make setup installed


@pytest.mark.parametrize("environment", INSTALLED)
def test_an_installed_environment_holds_exactly_its_lock(environment):
    build = install.install_record(environment)["build"]
    site = install.site_packages(environment)
    installed = {install.canonical(d.metadata["Name"]): d.version for d in distributions(path=[str(site)])}
    installed.pop("multigpu-notebooks")  # common/, editable
    installed.pop("pip")
    locked = pins(install.lock_file(environment, build))
    assert installed == locked


@pytest.mark.parametrize("environment", INSTALLED)
def test_no_two_distributions_of_an_installed_environment_own_the_same_file(environment):
    shared = install.shared_files(install.site_packages(environment))
    assert not shared, f"owned twice in {environment}: {dict(list(shared.items())[:10])}"


def test_the_record_check_finds_two_cuda_stacks_owning_one_library(tmp_path):
    """What pip does silently with torch's CUDA 13 and TensorFlow's CUDA 12 packages in one environment."""
    for name in ("nvidia_nccl_cu13-2.30.7", "nvidia_nccl_cu12-2.32.3"):
        (tmp_path / f"{name}.dist-info").mkdir()
        record = f"nvidia/nccl/lib/libnccl.so.2,sha256=x,1\n{name}.dist-info/RECORD,,\n"
        (tmp_path / f"{name}.dist-info" / "RECORD").write_text(record)
    assert install.shared_files(tmp_path) == {"nvidia/nccl/lib/libnccl.so.2": ["nvidia_nccl_cu12", "nvidia_nccl_cu13"]}


@pytest.mark.parametrize("environment", [name for name in INSTALLED if name != TOOLS])
def test_every_installed_environment_has_its_kernel_where_jupyterlab_looks(environment):
    from jupyter_client.kernelspec import KernelSpecManager

    spec = KernelSpecManager().get_kernel_spec(ENVIRONMENTS[environment].kernel)
    assert spec.argv[0] == str(ENVIRONMENTS[environment].python)
    assert spec.display_name == ENVIRONMENTS[environment].display_name


# ---------------------------------------------------------------- choosing a build from the driver


@pytest.mark.parametrize(
    ("gpu", "driver", "builds"),
    [
        (False, None, {"pytorch": "cuda13", "tensorflow": "cpu", "mxnet-chainer": "cpu"}),
        (True, "580.95.05", {"pytorch": "cuda13", "tensorflow": "cuda12", "mxnet-chainer": "cuda11"}),
        (True, "535.104.05", {"pytorch": "cuda12", "tensorflow": "cuda12", "mxnet-chainer": "cuda11"}),
        (True, None, {"pytorch": "cuda13", "tensorflow": "cuda12", "mxnet-chainer": "cuda11"}),  # a Docker build
    ],
)
def test_the_build_follows_the_driver(gpu, driver, builds):
    assert {name: install.choose_build(name, gpu, driver) for name in builds} == builds


def test_an_old_driver_gets_torch_from_the_cuda_12_index():
    plan = install.plan("pytorch", gpu=True, driver="535.104.05")
    commands = [" ".join(command) for command in plan.commands]
    assert any(f"--extra-index-url {install.TORCH_CUDA12_INDEX} torch==2.14.1+cu126 torchvision==0.29.1+cu126" in c
               for c in commands), commands  # fmt: skip
    rest = next(c for c in commands if "--no-deps numpy" in c or " numpy==" in c)
    assert "torch==" not in rest and "nvidia-cudnn" not in rest and "nvidia-ml-py==" in rest


def test_a_driver_too_old_for_any_build_is_refused_with_the_fix():
    with pytest.raises(install.SetupError, match=r"driver here is 470\.82\.01.*needs 525\.60\.13 or newer.*GPU=0"):
        install.choose_build("pytorch", True, "470.82.01")


def test_setup_asks_nvidia_smi_for_the_driver(tmp_path):
    """`make setup` on a GPU box with an old driver (a fake nvidia-smi) plans the CUDA 12 build of torch."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 535.104.05\n")
    fake.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "TORCH_CUDA12_INDEX": "https://example.org/whl/cu128"}
    out = subprocess.run([sys.executable, str(ENVS / "install.py"), "--dry-run", "pytorch"], env=env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "pytorch: cuda12 build" in out.stdout and "(driver 535.104.05)" in out.stdout
    assert "--extra-index-url https://example.org/whl/cu128 torch==2.14.1+cu128" in out.stdout


# ---------------------------------------------------------------- the layout of common/

NEUTRAL = ("data", "measure", "run", "teach")
FRAMEWORK_PACKAGES = {
    "pytorch": "pytorch",
    "tensorflow": "tensorflow",
    "mxnet": "mxnet-chainer",
    "chainer": "mxnet-chainer",
    "jax": "jax",
    "keras": "tensorflow and jax",  # Keras 3 on either backend
}
FRAMEWORK_MODULES = (
    "torch",
    "torchvision",
    "tensorflow",
    "keras",
    "mxnet",
    "chainer",
    "chainermn",
    "cupy",
    "jax",
    "flax",
)


def test_common_is_folders_by_job_and_by_framework():
    folders = {path.name for path in (ROOT / "common").iterdir() if path.is_dir() and path.name != "__pycache__"}
    assert folders == set(NEUTRAL) | set(FRAMEWORK_PACKAGES)
    loose = {path.name for path in (ROOT / "common").glob("*.py")}
    assert loose == {"__init__.py", "errors.py"}


def module_imports(path: Path, top_level_only: bool) -> set[str]:
    """The modules ``path`` imports (at import time only, or anywhere in it)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found


def common_modules() -> dict[str, Path]:
    modules = {}
    for path in (ROOT / "common").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return modules


def test_no_import_circle_in_common():
    modules = common_modules()
    graph = {
        name: {m for m in module_imports(path, False) if m in modules and m != name} for name, path in modules.items()
    }
    state: dict[str, str] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = "open"
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                circle = trail[trail.index(target) :] + [target] if target in trail else [name, target]
                pytest.fail(f"import circle: {' -> '.join(circle)}")
            if target not in state:
                visit(target, [*trail, target])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_framework_neutral_modules_import_no_framework_when_imported():
    for name, path in common_modules().items():
        parts = name.split(".")
        if len(parts) > 1 and parts[1] in FRAMEWORK_PACKAGES:
            continue
        imported = module_imports(path, top_level_only=True)
        frameworks = {m for m in imported if m.split(".")[0] in FRAMEWORK_MODULES}
        framework_helpers = {m for m in imported if m.split(".")[:2] in [["common", p] for p in FRAMEWORK_PACKAGES]}
        assert not frameworks | framework_helpers, f"{name} imports {frameworks | framework_helpers}"


def test_importing_every_neutral_module_imports_no_framework():
    neutral = sorted(name for name in common_modules() if name.split(".")[1:2] != [] and name.split(".")[1] in NEUTRAL)
    neutral = [name for name in neutral if not name.endswith("__main__")]
    code = (
        f"import sys\nfor name in {neutral!r}:\n    __import__(name)\n"
        f"print(sorted(m for m in {FRAMEWORK_MODULES!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
