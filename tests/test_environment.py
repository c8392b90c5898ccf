"""One pinned environment: requirements.txt is the source of truth, the other files agree with it."""

import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).parent.parent


def pins(path: Path) -> dict[str, str]:
    lines = [line.split("#")[0].strip() for line in path.read_text().splitlines()]
    found = {}
    for line in filter(None, lines):
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+(?:\[[a-z\-,]+\])?)==([0-9][0-9A-Za-z.+\-]*)", line)
        assert match, f"{path.name}: {line!r} is not pinned with =="
        found[match.group(1).lower()] = match.group(2)
    return found


def test_every_requirement_is_pinned_exactly():
    requirements = pins(ROOT / "requirements.txt")
    assert requirements["numpy"].startswith("1.26.")
    for framework in ("torch", "torchvision", "tensorflow", "keras", "mxnet", "chainer"):
        assert framework in requirements


def test_environment_yml_matches_requirements():
    environment = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert "python=3.11" in environment["dependencies"]
    pip_list = next(item["pip"] for item in environment["dependencies"] if isinstance(item, dict))
    from_yml = {}
    for line in pip_list:
        name, version = line.split("==")
        from_yml[name.lower()] = version
    assert from_yml == pins(ROOT / "requirements.txt")


def test_gpu_requirements_use_the_same_versions():
    base, gpu = pins(ROOT / "requirements.txt"), pins(ROOT / "requirements-gpu.txt")
    assert gpu["tensorflow[and-cuda]"] == base["tensorflow"]
    assert gpu["mxnet-cu112"] == base["mxnet"]


def test_installed_versions_match_the_pins():
    from importlib.metadata import version

    for name, pinned in pins(ROOT / "requirements.txt").items():
        assert version(name).split("+")[0] == pinned, name


def test_importing_common_imports_no_framework():
    code = (
        "import sys, common, common.chestxray, common.synthetic, common.devices, common.monitor, common.metrics, "
        "common.results, common.report, common.run, common.launch, common.params, common.mxnet_import, "
        "common.image_transforms, common.checkpoints\n"
        "frameworks = ('torch', 'tensorflow', 'keras', 'mxnet', 'chainer', 'chainermn')\n"
        "print(sorted(m for m in frameworks if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
