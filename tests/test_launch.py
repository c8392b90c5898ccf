"""The notebook launcher streams the workers' log and fails when any of them fails."""

import sys

import pytest

from common import launch

PY = sys.executable


def test_output_streams_through(capsys):
    launch.run([PY, "-c", "import sys; print('rank 0 ready'); sys.stdout.write('50%\\r100%\\n')"])
    assert capsys.readouterr().out == "rank 0 ready\n50%\r100%\n"


def test_environment_reaches_the_command(capsys):
    launch.run([PY, "-c", "import os; print(os.environ['OMP_NUM_THREADS'])"], env={"OMP_NUM_THREADS": "3"})
    assert capsys.readouterr().out == "3\n"


def test_failing_command_raises_with_its_last_lines():
    script = "import sys; print('epoch 1 done'); print('RuntimeError: rank 1 died', file=sys.stderr); sys.exit(3)"
    with pytest.raises(launch.LaunchError, match=r"exited with code 3(.|\n)*rank 1 died"):
        launch.run([PY, "-c", script])


def test_one_failing_torchrun_rank_fails_the_launch(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text("import os, sys\nsys.exit(5 if os.environ['RANK'] == '1' else 0)\n")
    command = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    with pytest.raises(launch.LaunchError, match="exited with code 1"):
        launch.run(command)
