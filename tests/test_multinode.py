"""Multi-node training, two "nodes" on one machine, each started by its framework's own launcher.

Every test starts the processes a user would start on two hosts, with the same commands and environment
variables, only with 127.0.0.1 for the host names and ports that are free right now. Each asserts that both
workers finished, that they hold identical weights (a sha256 each rank computes) and report the same metrics,
and that only the chief wrote outputs. Every launch has a time bound that names the launcher that hung, and
every process is killed on the way out, whether the test passed or not.
"""

import json
import os
import signal
import sys
from pathlib import Path

import cluster as multinode
import pytest
from elsewhere import call, python_of
from multinode_harness import assert_ranks_agree, papermill_command, write_config, write_script

from common.run import protocol
from common.run.launch import tf_config

# Tiny runs: the point is the launch and the agreement of the workers, not what the model learns.
TINY = dict(EPOCHS=1, IMAGE_SIZE=32, BATCH_SIZE_PER_DEVICE=8, MAX_IMAGES=240, BENCH_STEPS=1)
# Time bounds per launch: a few times what the tiny runs take on a busy 2-core machine. TensorFlow and MXNet workers
# run the whole notebook (TensorFlow traces DenseNet-121 on the CPU, over a minute per traced function there; two
# MXNet workers and a server took 130-180 s).
LAUNCH_TIMEOUT = 180
NOTEBOOK_LAUNCH_TIMEOUT = 480


# The error Keras 3 model.fit raises under MultiWorkerMirroredStrategy (keras-team/keras#20585).
KERAS_MULTI_WORKER_ERROR = "Attempt to convert a value (PerReplica"


@pytest.fixture
def cluster(tmp_path):
    with multinode.Cluster(tmp_path / "logs") as started:
        yield started


@pytest.mark.environments("pytorch")
def test_pytorch_torchrun_two_nodes(notebook_data, tmp_path, cluster):
    script = write_script("PyTorch_MultiGPU", "train_ddp.py", tmp_path)
    endpoint = f"127.0.0.1:{multinode.free_port()}"
    nodes = []
    for node in (0, 1):  # each "host" has its own work folder, as two machines have their own disks
        # as the notebook prints it: this machine's config (one device), made the whole run's for two nodes
        config = protocol.multinode_config(write_config(tmp_path / f"host{node}", notebook_data, 1, TINY), nodes=2)
        command = call("pytorch", "common.pytorch.utils.torchrun_multinode_command", script, 2, 1, endpoint,
                       "multinode-test", config)  # fmt: skip
        nodes.append(
            cluster.start(f"torchrun node {node}", command, env=call("pytorch", "common.pytorch.utils.launch_env", 2))
        )
    cluster.check(nodes, LAUNCH_TIMEOUT)

    written = [node for node in (0, 1) if (tmp_path / f"host{node}" / "train.json").exists()]
    assert len(written) == 1, f"results written on hosts {written}: the chief (rank 0) alone must write"
    result = protocol.read_result(tmp_path / f"host{written[0]}", "train")
    assert_ranks_agree(result["ranks"], world_size=2)
    assert result["history"]["train_loss"][-1] == result["ranks"][0]["train_loss"] and len(result["scores"])


# Stand-ins for Slurm's commands on one machine: every node of the job is this host, and srun starts its command once
# per node (the script asks for one task per node), failing when any of them fails.
SCONTROL = "#!/bin/sh\necho localhost\n"
SRUN = """#!/bin/bash
pids=()
for node in $(seq "$SLURM_NNODES"); do SLURM_NODEID=$((node - 1)) "$@" & pids+=($!); done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
exit $status
"""


@pytest.mark.environments("pytorch")
def test_pytorch_slurm_batch_script(notebook_data, tmp_path, cluster):
    """The batch script the PyTorch notebooks print for a Slurm cluster, run as sbatch would run it on two nodes."""
    script = write_script("DataParallel_From_Scratch", "train_scratch.py", tmp_path)
    options = dict(gradients="average", same_initial_weights=True, set_epoch=True, batch_norm="local")
    config = protocol.multinode_config(write_config(tmp_path, notebook_data, 1, TINY, **options), nodes=2)
    port = multinode.free_port()
    batch = tmp_path / "train.sbatch"
    batch.write_text(call("pytorch", "common.pytorch.utils.slurm_script", script, 2, 1, config, 1, "cpu", port))
    stand_ins = tmp_path / "bin"
    stand_ins.mkdir()
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN)):
        (stand_ins / name).write_text(text)
        (stand_ins / name).chmod(0o755)
    job = dict(SLURM_JOB_ID=f"job{port}", SLURM_JOB_NODELIST="localhost", SLURM_NNODES="2")
    job["PATH"] = f"{stand_ins}:{os.environ['PATH']}"
    launcher = cluster.start("sbatch stand-in", ["bash", batch], env=job)
    cluster.check([launcher], LAUNCH_TIMEOUT)

    result = protocol.read_result(tmp_path, "train")  # one work folder: rank 0 alone writes it
    assert sorted(report["rank"] for report in result["ranks"]) == [0, 1]
    assert result["replicas_apart"] == 0, "the two nodes' processes trained one model"


@pytest.mark.environments("mxnet-chainer")
def test_chainermn_mpiexec_two_hosts(notebook_data, tmp_path, cluster):
    script = write_script("Chainer_MultiGPU", "train_chainermn.py", tmp_path)
    # as the notebook prints it: this machine's config (one device), made the whole run's for two hosts
    config = protocol.multinode_config(write_config(tmp_path, notebook_data, 1, TINY, precision_used="fp32"), nodes=2)
    # two host names for this machine: Hydra starts local processes for both, as it would over ssh for real hosts
    build = "common.chainer.utils.mpiexec_hosts_command"
    command = call("mxnet-chainer", build, script, ["127.0.0.1", "localhost"], 1, config)
    env = call("mxnet-chainer", "common.chainer.utils.launch_env", 2)
    launcher = cluster.start("mpiexec -hosts 127.0.0.1:1,localhost:1", command, env=env)
    cluster.check([launcher], LAUNCH_TIMEOUT)

    result = protocol.read_result(tmp_path, "train")  # one work folder: rank 0 alone writes it
    assert_ranks_agree(result["ranks"], world_size=2)
    assert result["history"]["train_loss"][-1] == result["ranks"][0]["train_loss"] and len(result["scores"])


@pytest.mark.environments("tensorflow")
def test_tensorflow_two_workers_with_tf_config(notebook_data, tmp_path, cluster):
    # TensorFlow runs in the workers only, each a notebook, as on two hosts
    workers = [f"127.0.0.1:{port}" for port in multinode.free_ports(2)]
    nodes = []
    for index in (0, 1):  # each worker has its own results folder, as two machines have their own disks
        parameters = dict(TINY, DATA_DIR=str(notebook_data), RESULTS_DIR=str(tmp_path / f"worker{index}" / "results"))
        command = papermill_command(
            "Tensorflow_MultiGPU", tmp_path / f"worker{index}.ipynb", STRATEGY="multi_worker", DEVICES=1, **parameters
        )
        env = {"TF_CONFIG": tf_config(workers, index)}  # common.tensorflow.imports quiets the C++ notices
        nodes.append(cluster.start(f"TensorFlow worker {index} (papermill)", command, env=env, core=index))
    cluster.check(nodes, NOTEBOOK_LAUNCH_TIMEOUT)

    reports = [protocol.read_glued(tmp_path / f"worker{index}.ipynb")["rank_report"] for index in (0, 1)]
    assert_ranks_agree(reports, world_size=2)
    chief, other = (list((tmp_path / f"worker{index}" / "results").glob("*.json")) for index in (0, 1))
    assert not other, f"worker 1 wrote records: {other}"
    records = {record["data"]: record for record in map(json.loads, (path.read_text() for path in chief))}
    assert set(records) == {"generated", "synthetic-in-RAM"}
    assert records["generated"]["devices"] == 2, "the record counts the replicas of both workers"
    assert records["generated"]["test_auc"] == reports[0]["test_auc"]


def start_gluon_cluster(cluster, folder: Path, roles: dict, data_dir, **settings) -> list[multinode.Node]:
    """A scheduler and a server (on host1 in a real run) and two workers, each a notebook, as on two hosts."""
    node = [python_of("mxnet-chainer"), "-m", "common.mxnet.cluster"]
    folder.mkdir()
    server = {**roles, "DMLC_ROLE": "server", "OMP_NUM_THREADS": "1"}
    started = [
        cluster.start(f"MXNet scheduler {folder.name}", node, env={**roles, "DMLC_ROLE": "scheduler"}),
        cluster.start(f"MXNet server {folder.name}", node, env=server),
    ]
    for index in (0, 1):  # each worker has its own results folder, as two machines have their own disks
        parameters = dict(TINY, DATA_DIR=str(data_dir), RESULTS_DIR=str(folder / f"worker{index}" / "results"))
        parameters.update(settings)
        command = papermill_command(
            "Gluon_MultiGPU", folder / f"worker{index}.ipynb", KVSTORE="dist_sync", DEVICES=1, **parameters
        )
        worker_env = {**roles, "DMLC_ROLE": "worker"}
        started.append(cluster.start(f"MXNet worker {index} {folder.name}", command, env=worker_env, core=index))
    return started


@pytest.mark.environments("mxnet-chainer")
def test_gluon_dist_sync_scheduler_server_two_workers(notebook_data, tmp_path, cluster):
    roles = {
        "DMLC_PS_ROOT_URI": "127.0.0.1",
        "DMLC_PS_ROOT_PORT": str(multinode.free_port()),
        "DMLC_NUM_SERVER": "1",
        "DMLC_NUM_WORKER": "2",
    }
    # Ctrl-C on one worker in its first epoch: the scheduler's watch (common.mxnet.cluster) stops every other node
    # (MXNet numbers the workers in the order they join, so its rank is unknown here)
    interrupted = start_gluon_cluster(cluster, tmp_path / "interrupted", roles, notebook_data, EPOCHS=3)
    first = interrupted[2]
    multinode.wait_until(lambda: "epoch 1/3" in first.output, "worker's first epoch", NOTEBOOK_LAUNCH_TIMEOUT, first)
    first.process.send_signal(signal.SIGINT)
    codes = cluster.wait(interrupted, timeout=30)
    assert all(code != 0 for code in codes.values()), f"a node finished a run whose worker 0 was interrupted: {codes}"
    assert "Stopped the MXNet cluster: worker " in interrupted[0].output
    assert "left before the end (it was interrupted)" in interrupted[0].output
    assert "Stopped worker " in interrupted[3].output and "Stopped server on " in interrupted[1].output

    # the same ports again: the whole run
    started = start_gluon_cluster(cluster, tmp_path / "run", roles, notebook_data)
    cluster.check(started[2:], NOTEBOOK_LAUNCH_TIMEOUT)
    cluster.check(started[:2], 30)  # the scheduler and the server exit when the workers leave

    reports = [protocol.read_glued(tmp_path / "run" / f"worker{index}.ipynb")["rank_report"] for index in (0, 1)]
    # the train loss is each worker's own part of the batches; the weights and the test must agree
    assert_ranks_agree(reports, world_size=2, same_loss=False)
    written = [list((tmp_path / "run" / f"worker{index}" / "results").glob("*.json")) for index in (0, 1)]
    assert sorted(map(len, written)) == [0, 2], f"records written: {written}: worker 0 alone writes them"
    records = {record["data"]: record for record in map(json.loads, (p.read_text() for p in written[0] + written[1]))}
    assert records["generated"]["devices"] == 2 and records["generated"]["kvstore"] == "dist_sync"
    assert records["generated"]["test_auc"] == reports[0]["test_auc"]


@pytest.mark.environments("tensorflow")
def test_keras_fit_under_multi_worker_fails_as_documented(tmp_path, cluster):
    """The Keras notebook refuses STRATEGY="multi_worker" because model.fit fails there: hold that to the truth."""
    script = Path(__file__).parent / "tensorflow" / "keras_multi_worker_fit.py"
    workers = [f"127.0.0.1:{port}" for port in multinode.free_ports(2)]
    workers = [
        cluster.start(
            f"Keras worker {index}",
            [python_of("tensorflow"), str(script)],
            env={"TF_CONFIG": tf_config(workers, index), "TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1"},
        )
        for index in (0, 1)
    ]
    codes = cluster.wait(workers, LAUNCH_TIMEOUT)
    if all(code == 0 for code in codes.values()):
        pytest.fail(
            "Keras model.fit now trains under MultiWorkerMirroredStrategy (keras-team/keras#20585 looks fixed): "
            "enable STRATEGY='multi_worker' in Keras_TF_MultiGPU (tfu.check_keras_strategy and its notes) and make "
            "this a two-worker training test like the TensorFlow one."
        )
    for worker in workers:
        assert codes[worker.name] != 0 and KERAS_MULTI_WORKER_ERROR in worker.output, (
            f"{worker.name} failed in another way than keras-team/keras#20585 (exit {codes[worker.name]}):\n"
            + worker.tail()
        )


def test_multinode_cluster_names_the_launcher_that_hung(tmp_path):
    with multinode.Cluster(tmp_path) as cluster:
        quick = cluster.start("quick", [sys.executable, "-c", "pass"])
        stuck = cluster.start("stuck launcher", [sys.executable, "-c", "import time; time.sleep(60)"])
        with pytest.raises(multinode.LaunchTimeout, match="stuck launcher did not finish"):
            cluster.wait([quick, stuck], timeout=3)
    assert stuck.process.returncode is not None, "the hung process was not stopped"


def test_a_node_answers_ctrl_c_even_when_the_suite_runs_with_sigint_ignored(tmp_path):
    """A shell that runs the suite in the background ignores SIGINT, and children inherit that: a papermill worker
    then finished the run it was told to stop, and every node of the Gluon test above exited 0."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as under `make test &` or nohup
    try:
        with multinode.Cluster(tmp_path) as cluster:
            code = (
                "import signal, time; handler = signal.getsignal(signal.SIGINT)\n"
                "print(getattr(handler, '__name__', handler), flush=True); time.sleep(60)"
            )
            node = cluster.start("worker", [sys.executable, "-c", code])
            multinode.wait_until(lambda: node.output.strip(), "the node to start", 30, node)
            node.process.send_signal(signal.SIGINT)
            assert cluster.wait([node], timeout=10) == {"worker": -signal.SIGINT}, node.output
    finally:
        signal.signal(signal.SIGINT, previous)
    assert node.output.startswith("default_int_handler") and "KeyboardInterrupt" in node.output
