"""For a test that runs code in another environment than its own: the tools' tests drive framework processes, and a
framework's test may compare with another framework (Chainer's DenseNet with torchvision's)."""

import json
import subprocess
from pathlib import Path

from common.run.environments import ENVIRONMENTS


def python_of(environment: str) -> str:
    """The Python of ``environment``, as ``make setup`` builds it."""
    python = ENVIRONMENTS[environment].python
    assert python.exists(), f"the {environment} environment is not installed: make setup FRAMEWORKS={environment}"
    return str(python)


def call(environment: str, function: str, *args):
    """``module.function(*args)`` evaluated by ``environment``'s Python (``function`` as ``common.pytorch.utils.x``);
    its JSON result. Launch commands come from here: they name the Python that builds them."""
    module, name = function.rsplit(".", 1)
    args = [str(arg) if isinstance(arg, Path) else arg for arg in args]
    code = f"import json, {module} as m\nprint(json.dumps(m.{name}(*{args!r})))"
    out = subprocess.run([python_of(environment), "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def value(environment: str, name: str):
    """The value of ``module.NAME`` in ``environment`` (as JSON), for a test that checks a notebook's record against
    a constant of a framework's helpers."""
    module, attribute = name.rsplit(".", 1)
    code = f"import json, {module} as m\nprint(json.dumps(m.{attribute}))"
    out = subprocess.run([python_of(environment), "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
