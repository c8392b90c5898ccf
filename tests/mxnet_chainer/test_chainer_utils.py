"""The Chainer notebook's helpers: the import fix, DenseNet-121 parity, ChainerMN data parallelism, input pipeline."""

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from elsewhere import python_of

from common.chainer import utils as cu
from common.chainer.imports import chainer, chainermn
from common.data import chestxray
from common.errors import InputError
from common.run import checkpoints, launch
from common.run.params import IMAGENET_MEAN, IMAGENET_STD, NUM_CLASSES

HERE = Path(__file__).parent
# float32 sums of 4 vs 8 images in a different order: the weights of 1 and 2 ranks agree to about 1e-7
TOLERANCE = 1e-6


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_import_helper_makes_chainer_importable_without_warnings():
    assert chainer.__version__ == "7.8.1" and chainermn.create_communicator
    # a fresh interpreter, warnings as errors: the pkg_resources and distutils warnings are silenced, nothing else
    out = run_python("import warnings; warnings.simplefilter('error'); from common.chainer.imports import chainer")
    assert out.returncode == 0, out.stderr[-2000:]


def test_import_helper_refuses_when_setuptools_distutils_came_first():
    out = run_python("import setuptools, distutils; import common.chainer.imports")
    assert out.returncode != 0
    assert "setuptools' copy of distutils" in out.stderr and "before Chainer" in out.stderr


def test_densenet_has_the_shared_parameter_count_and_takes_small_images():
    model = cu.build_densenet121(seed=0)
    assert cu.trainable_parameters(model) == 6_968_206
    with chainer.using_config("train", False), chainer.no_backprop_mode():
        for size in (32, 64):
            assert model(np.zeros((2, 3, size, size), np.float32)).shape == (2, NUM_CLASSES)


@pytest.mark.environments("pytorch")
def test_densenet_computes_what_torchvision_computes(tmp_path):
    """The same weights give the same outputs as torchvision's densenet121, in training and in evaluation mode
    (torchvision's side computed in the PyTorch environment, by ``tests/pytorch/densenet_reference.py``)."""
    script = HERE.parent / "pytorch" / "densenet_reference.py"
    out = subprocess.run([python_of("pytorch"), str(script), str(tmp_path / "reference.npz")], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    reference = np.load(tmp_path / "reference.npz")
    model = cu.build_densenet121(seed=0)
    layers = [model.conv0, model.norm0]
    for ours in model.features:
        names = ("norm1", "conv1", "norm2", "conv2") if isinstance(ours, cu.DenseLayer) else ("norm", "conv")
        layers += [getattr(ours, name) for name in names]
    layers += [model.norm5, model.classifier]
    assert len(layers) == len(reference["kinds"])
    for index, (ours, kind) in enumerate(zip(layers, reference["kinds"], strict=True)):
        if kind == "norm":
            ours.gamma.array[...], ours.beta.array[...] = reference[f"{index}/weight"], reference[f"{index}/bias"]
            ours.avg_mean[...], ours.avg_var[...] = (
                reference[f"{index}/running_mean"],
                reference[f"{index}/running_var"],
            )
        else:
            ours.W.array[...] = reference[f"{index}/weight"]
            if f"{index}/bias" in reference:
                ours.b.array[...] = reference[f"{index}/bias"]
    for mode in ("eval", "train"):
        with chainer.using_config("train", mode == "train"), chainer.no_backprop_mode():
            ours = model(reference["images"]).array
        np.testing.assert_allclose(ours, reference[mode], rtol=1e-3, atol=1e-4, err_msg=mode)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """Every variant of the step in ``chainer_replicas.py``, on 1 and on 2 MPI ranks: ``{ranks: npz}``."""
    out = tmp_path_factory.mktemp("replicas")
    found = {}
    for ranks in (1, 2):
        command = cu.mpiexec_command(HERE / "chainer_replicas.py", ranks, out / f"{ranks}.npz")
        launch.run(command, env={**cu.launch_env(ranks), "PYTHONPATH": str(HERE.parents[1])}, cwd=HERE)
        found[ranks] = dict(np.load(out / f"{ranks}.npz"))
    return found


def weights(found: dict, variant: str, rank: int) -> dict[str, np.ndarray]:
    prefix = f"{variant}/{rank}/"
    return {key[len(prefix) :]: value for key, value in found.items() if key.startswith(prefix)}


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a
    return max(float(np.abs(a[name] - b[name]).max()) for name in a)


@pytest.mark.parametrize("variant", ["sgd", "adam"])
def test_two_ranks_take_the_same_step_as_one_process(replicas, variant):
    """One step on 2 ranks (4 images each) equals one step on 1 rank with the same 8 images; no batch norm."""
    single = weights(replicas[1], variant, 0)
    for rank in (0, 1):
        assert max_difference(weights(replicas[2], variant, rank), single) < TOLERANCE
    # the step is far larger than the tolerance (SGD 0.5: ~0.017; Adam 0.01: ~0.01), so equality is not trivial
    assert max_difference(single, weights(replicas[1], "initial", 0)) > 1e-3


def test_a_wrong_loss_normalization_would_be_caught(replicas):
    """Dividing each rank's loss by the global batch (right only where gradients are summed) halves the SGD step."""
    single = weights(replicas[1], "sgd", 0)
    wrong = weights(replicas[2], "sgd_divided_by_global_batch", 0)
    step = max_difference(single, weights(replicas[1], "initial", 0))
    assert max_difference(wrong, single) > 0.25 * step > 1000 * TOLERANCE


def test_batch_norm_statistics_stay_per_rank_until_shared(replicas):
    """The known exception, shown: each rank's running mean follows its own images; averaging makes them agree."""
    two = replicas[2]
    own = [two[f"bn_own/{rank}/avg_mean"] for rank in (0, 1)]
    assert not np.allclose(own[0], own[1], atol=1e-4)
    shared = [two[f"bn_shared/{rank}/avg_mean"] for rank in (0, 1)]
    np.testing.assert_allclose(shared[0], shared[1], rtol=0, atol=0)
    np.testing.assert_allclose(shared[0], (own[0] + own[1]) / 2, atol=1e-7)
    # gradients are averaged, so the trained weights agree across ranks (but not with one process: batch statistics)
    assert max_difference(weights(two, "bn_trained", 0), weights(two, "bn_trained", 1)) == 0
    assert max_difference(weights(two, "bn_trained", 0), weights(replicas[1], "bn_trained", 0)) > 10 * TOLERANCE


def test_precise_batch_norm_is_the_plain_mean_of_all_ranks_batches(replicas):
    import chainer_replicas

    for ranks in (1, 2):
        model = chainer_replicas.Small(batch_norm=True)
        for name, param in model.namedparams():
            param.array[...] = replicas[ranks][f"bn_trained/0/{name}"]
        features = model.conv(chainer_replicas.make_batch()[0]).array  # the 8 images, all ranks together
        recomputed = [replicas[ranks][f"bn_recomputed/{rank}/avg_mean"] for rank in range(ranks)]
        for mean in recomputed:
            np.testing.assert_allclose(mean, features.mean(axis=(0, 2, 3)), atol=1e-6)
        assert int(replicas[ranks]["bn_recomputed/0/batches"]) == 2


def test_a_failing_rank_fails_the_launch():
    """Rank 1 raises while rank 0 waits in an all-reduce: ChainerMN's except hook aborts both, the launch fails."""
    command = cu.mpiexec_command(HERE / "chainer_replicas.py", 2, "fail")
    env = {**cu.launch_env(2), "PYTHONPATH": str(HERE.parents[1]), "MPIEXEC_TIMEOUT": "120"}  # a hang fails, not blocks
    start = time.perf_counter()
    with pytest.raises(launch.LaunchError, match="exited with code"):
        launch.run(command, env=env, cwd=HERE)
    assert time.perf_counter() - start < 60, "the waiting rank was not stopped by the failing one"


@pytest.fixture(scope="module")
def train_split(standin):
    return chestxray.load(standin, seed=0)["train"]


@pytest.fixture(scope="module")
def images(train_split):
    return cu.ChestXrayImages(train_split, np.arange(len(train_split))[::-1], image_size=32, seed=7)


def test_augmentation_is_a_function_of_seed_epoch_and_image(images, train_split):
    first = [images.load(index, epoch=0)[0] for index in range(6)]
    again = [images.load(index, epoch=0)[0] for index in range(6)]
    later = [images.load(index, epoch=1)[0] for index in range(6)]
    other = cu.ChestXrayImages(train_split, images.indices, image_size=32, seed=8)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not all(np.array_equal(a, b) for a, b in zip(first, later))
    assert not all(np.array_equal(a, other.load(i, epoch=0)[0]) for i, a in enumerate(first))
    image, labels, index = images[0]  # evaluation: no randomness; items name their image
    assert image.shape == (1, 32, 32) and image.dtype == np.uint8 and labels.dtype == np.int32
    assert int(index) == images.indices[0] and np.array_equal(image, images[0][0])


@pytest.mark.parametrize("dtype", [None, np.float32, np.float16])
def test_the_device_normalizes_the_gray_bytes_as_the_host_did_then_casts(images, dtype):
    """The items stay uint8 gray up to the device; there they become the float32 values the host computed before
    (``tests/test_image_transforms.py`` checks the pixels themselves), then the compute dtype."""
    batch = [images[position] for position in range(4)]
    x, labels, index = cu.to_device(batch, chainer.get_device("@numpy"), dtype)
    gray = np.stack([item[0] for item in batch])
    mean, std = (np.array(values, np.float32)[:, None, None] for values in (IMAGENET_MEAN, IMAGENET_STD))
    np.testing.assert_array_equal(x, ((gray.astype(np.float32) / 255 - mean) / std).astype(dtype or np.float32))
    assert x.shape == (4, 3, 32, 32) and labels.shape == (4, NUM_CLASSES) and list(index) == list(images.indices[:4])


def test_the_benchmark_step_normalizes_gray_bytes_on_the_device_as_training_does():
    seen = []

    def model(x):
        seen.append(x)
        return chainer.Variable(np.zeros((len(x), NUM_CLASSES), np.float32))

    class Optimizer:
        update = staticmethod(lambda loss: loss())

    class TwoRanks:
        size = 2

    rate = cu.time_steps(model, Optimizer, 4, 32, 3, chainer.get_device("@numpy"), TwoRanks, np.float16)
    assert len(seen) == 5 and rate > 0
    assert all(x.shape == (4, 3, 32, 32) and x.dtype == np.float16 for x in seen)
    gray = [seen[0][:, channel] * std + mean for channel, (mean, std) in enumerate(zip(IMAGENET_MEAN, IMAGENET_STD))]
    np.testing.assert_allclose(gray[0], gray[1], atol=1e-2)  # one gray image made three channels
    assert 0 <= min(g.min() for g in gray) and max(g.max() for g in gray) <= 1.01


@pytest.mark.filterwarnings("ignore:setDaemon:DeprecationWarning")  # inside Chainer 7.8.1
def test_training_epochs_shuffle_each_epoch_and_decode_the_same_in_worker_processes(images):
    epochs = cu.TrainingEpochs(images, batch_size=4, epochs=2, seed=3)
    per_epoch = epochs.steps_per_epoch * 4
    assert len(epochs) == 2 * per_epoch and per_epoch <= len(images) < per_epoch + 4
    numbers = [int(epochs[k][2]) for k in range(len(epochs))]
    assert sorted(numbers[:per_epoch]) == sorted(set(numbers[:per_epoch]))  # no image twice in one epoch
    assert numbers[:per_epoch] != numbers[per_epoch:]  # a new order each epoch
    with cu.iterator(epochs, 4, workers=2) as batches:
        parallel = [item for batch in batches for item in batch]
    assert [int(item[2]) for item in parallel] == numbers
    assert all(np.array_equal(item[0], epochs[k][0]) for k, item in enumerate(parallel))
    with pytest.raises(InputError, match="fewer than one batch"):
        cu.TrainingEpochs(images, batch_size=len(images) + 1, epochs=1)


def test_cpu_runs_fp32_and_the_naive_communicator():
    assert cu.precision_used("mixed", "cpu") == "fp32" and cu.precision_used("mixed", "gpu") == "mixed16"
    assert cu.precision_used("fp32", "gpu") == "fp32"
    assert cu.communicator_name("cpu") == "naive" and cu.communicator_name("gpu") == "pure_nccl"
    env = cu.launch_env(2)
    assert env["OMP_NUM_THREADS"] == env["OPENBLAS_NUM_THREADS"] == str(cu.threads_per_device(2))
    assert Path(cu.mpiexec_command("train.py", 2, "config.json")[0]).name == "mpiexec"


def test_gpus_chainer_cannot_train_on_stop_the_notebook_naming_what_failed(monkeypatch):
    check = cu.check_gpu(1)  # no usable GPU in these tests: the reason is named, nothing raises
    if not chainer.backends.cuda.available:
        assert not check.ok and "CuPy" in check.message
    gpu_box = cu.devices.Devices("gpu", 2, 2, ("GPU A", "GPU B"))
    monkeypatch.setattr(cu.devices, "resolve", lambda requested: gpu_box)
    monkeypatch.setattr(cu.devices, "driver_version", lambda: "535.104.05")
    monkeypatch.setattr(cu, "check_gpu", lambda count: cu.GPUCheck(False, "a small convolution on @cupy:0 failed"))
    with pytest.raises(InputError, match=r"driver 535\.104\.05.*Chainer 7\.8\.1 with .*can use 0 of the 2 asked for "
                                         r"\(a small convolution on @cupy:0 failed\)"):  # fmt: skip
        cu.resolve_devices(2)
    monkeypatch.setattr(cu, "check_gpu", lambda count: cu.GPUCheck(True, "fine"))
    assert cu.resolve_devices(2) is gpu_box


def test_cupys_cuda_libraries_load_from_nvidias_pip_packages_dependencies_first(tmp_path):
    """CuPy 13 links libcublas.so.11, libcudnn.so.8, ... by name: loaded from nvidia-*-cu11 first, in an order in
    which each library's dependencies are already there."""
    from common.chainer import imports

    names = ["cudnn/lib/libcudnn.so.8", "cudnn/lib/libcudnn_ops_infer.so.8", "cublas/lib/libcublas.so.11",
             "cublas/lib/libcublasLt.so.11", "cuda_nvrtc/lib/libnvrtc.so.11.2", "cuda_runtime/lib/libcudart.so.11.0",
             "nccl/lib/libnccl.so.2", "cublas/lib/libcublas.so", "cublas/include/cublas.h"]  # fmt: skip
    for name in names:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).touch()
    found = [path.name for path in imports.pip_cuda_libraries([str(tmp_path)])]
    assert found == ["libcudart.so.11.0", "libcublasLt.so.11", "libcublas.so.11", "libnvrtc.so.11.2",
                     "libcudnn_ops_infer.so.8", "libcudnn.so.8", "libnccl.so.2"]  # fmt: skip


def test_pretrained_weights_are_refused_with_the_reason():
    with pytest.raises(InputError, match="no ImageNet DenseNet-121 weights"):
        cu.check_pretrained(True)
    cu.check_pretrained(False)


class OneRank:
    """The communicator interface that saving a checkpoint uses, for a single process."""

    rank = 0

    class mpi_comm:  # noqa: N801 (mpi4py's name)
        @staticmethod
        def Barrier():  # noqa: N802
            pass


def test_a_restored_checkpoint_continues_exactly_like_the_uninterrupted_run(tmp_path):
    """The weights and Adam's state (its step count and moments) come back into a fresh model and optimizer."""
    batches = [np.random.default_rng(step).normal(size=(8, 4)).astype(np.float32) for step in range(6)]

    def build(seed):
        model = chainer.links.Linear(4, 2, initialW=np.random.default_rng(seed).normal(size=(2, 4)).astype(np.float32))
        optimizer = chainer.optimizers.Adam(alpha=0.1)
        optimizer.setup(model)
        return model, optimizer

    def train(model, optimizer, steps):
        for batch in steps:
            loss = chainer.functions.mean(model(batch) ** 2)
            model.cleargrads()
            loss.backward()
            optimizer.update()

    model, optimizer = build(0)
    train(model, optimizer, batches[:3])
    cu.save_checkpoint(tmp_path, 3, {"EPOCHS": 6}, {"train_loss": [0.5]}, model, optimizer, OneRank)
    train(model, optimizer, batches[3:])

    resumed, resumed_optimizer = build(1)
    epoch, history = cu.load_checkpoint(checkpoints.complete(tmp_path)[-1], resumed, resumed_optimizer)
    assert epoch == 3 and history == {"train_loss": [0.5]} and resumed_optimizer.t == 3
    train(resumed, resumed_optimizer, batches[3:])
    np.testing.assert_array_equal(resumed.W.array, model.W.array)
    np.testing.assert_array_equal(resumed.b.array, model.b.array)
