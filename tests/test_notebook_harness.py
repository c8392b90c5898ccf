"""The harness runs a notebook in a kernel that behaves as a user's: what the kernel writes to file descriptor 2 (the
C++ log lines of TensorFlow, MXNet or a launcher) reaches the executed notebook, where the stderr checks read it."""

import nbformat
from notebook_harness import execute, stderr_noise


def test_what_a_kernel_writes_to_file_descriptor_2_reaches_the_notebook(tmp_path):
    notebook = tmp_path / "writes-to-fd-2.ipynb"
    source = "import os, time\nos.write(2, b'W0000 a C++ log line\\n')\ntime.sleep(0.5)  # the kernel forwards it"
    python = {"language_info": {"name": "python"}}
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)], metadata=python), notebook)
    executed = execute(notebook, tmp_path / "data", tmp_path / "run", kernel="python3", DEVICES=1)
    assert stderr_noise(executed) == ["W0000 a C++ log line"]
