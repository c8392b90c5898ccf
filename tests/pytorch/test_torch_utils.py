"""The PyTorch pieces the notebook's training script is built from."""

import sys

import numpy as np
import pytest
import torch
from png_modes import HEIGHT, MODES, WIDTH, write
from torch.utils.data import DataLoader
from torchvision.transforms import v2

from common.data import chestxray
from common.data.chestxray import Split
from common.errors import InputError
from common.measure.phases import Phases
from common.pytorch import utils as tu
from common.run import checkpoints
from common.run.params import IMAGENET_MEAN, IMAGENET_STD


def test_gpus_this_torch_cannot_use_stop_the_notebook_before_training(monkeypatch):
    """NVML lists GPUs, torch.cuda does not (an old driver for this CUDA build): a stop naming it, not hours on the
    CPU."""
    gpus = tu.devices.Devices("gpu", 2, 2, ("NVIDIA A100-SXM4-80GB",) * 2, 80.0, (8, 0))
    monkeypatch.setattr(tu.devices, "resolve", lambda requested: gpus)
    monkeypatch.setattr(tu.devices, "driver_version", lambda: "535.104.05")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    with pytest.raises(InputError, match=r"driver 535\.104\.05.*torch .*built for CUDA 13\.0.*580\.65\.06.*make setup"):
        tu.resolve_devices(None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert tu.resolve_devices(None) is gpus


def test_densenet121_has_the_shared_parameter_count_and_the_sizes_data_parallelism_moves():
    model = tu.build_densenet121()
    assert tu.trainable_parameters(model) == 6_968_206
    sizes = tu.transfer_bytes(model, 224)
    assert sizes["gradients"] == 4 * 6_968_206 < sizes["weights"], "the weights add BatchNorm's running statistics"
    assert sizes["image"] == 3 * 224 * 224 * 4 and sizes["output"] == 14 * 4


@pytest.mark.parametrize("mode", MODES)
def test_the_dataset_decodes_every_png_mode_to_the_shared_pixels(tmp_path, mode):
    path, expected = write(tmp_path, mode)
    image = tu.ChestXrayDataset(Split([path], np.zeros((1, 14)), np.zeros(1)), lambda x: x)[0][0].numpy()
    assert image.dtype == np.uint8 and image.shape == (1, HEIGHT, WIDTH)
    np.testing.assert_array_equal(image[0], expected)


@pytest.fixture(scope="module")
def splits(standin):
    return chestxray.load(standin, seed=0)


def test_loaders_send_uint8_gray_images_that_become_normalized_three_channels_on_the_device(splits):
    """A twelfth of the bytes through shared memory and the host-to-device copy; the model sees what it saw when the
    loader workers converted to float RGB and normalized (torchvision's ToDtype, three channels, Normalize)."""
    dataset = tu.ChestXrayDataset(splits["train"], tu.train_transform(24))
    image, labels, index = dataset[3]
    assert image.shape == (1, 24, 24) and image.dtype == torch.uint8
    assert torch.equal(labels, torch.as_tensor(splits["train"].labels[3])) and index == 3
    batch = torch.stack([image, dataset[4][0]])
    model_input = tu.to_model_input(batch, torch.device("cpu"), torch.channels_last)
    on_workers = v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)(
        v2.ToDtype(torch.float32, scale=True)(batch).expand(-1, 3, -1, -1)
    )
    assert model_input.shape == (2, 3, 24, 24) and model_input.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(model_input, on_workers)
    evaluated, _, _ = tu.ChestXrayDataset(splits["test"], tu.eval_transform(24))[0]
    again, _, _ = tu.ChestXrayDataset(splits["test"], tu.eval_transform(24))[0]
    assert torch.equal(evaluated, again)  # evaluation is deterministic


def test_unreadable_image_during_training_names_the_file(tmp_path):
    bad = tmp_path / "00000001_000.png"
    bad.write_bytes(b"not a png")
    split = chestxray.Split([str(bad)], np.zeros((1, 14), np.float32), np.zeros(1))
    dataset = tu.ChestXrayDataset(split, tu.eval_transform(16))
    with pytest.raises(InputError, match="00000001_000.png"):
        dataset[0]


def test_predict_all_scores_every_image_once_in_order(splits):
    test = splits["test"]
    dataset = tu.ChestXrayDataset(test, tu.eval_transform(16))
    loader = DataLoader(dataset, batch_size=7)
    model = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(3, 14))
    labels, scores = tu.predict_all(model, loader, tu.Process(0, 1, 0, torch.device("cpu")), "fp32")
    assert labels.shape == scores.shape == (len(test), 14)
    np.testing.assert_array_equal(labels, test.labels)
    assert ((scores > 0) & (scores < 1)).all()


def test_mixed_precision_on_cpu_is_bf16_without_loss_scaling():
    cpu = torch.device("cpu")
    assert tu.mixed_dtype(cpu) == torch.bfloat16
    assert not tu.grad_scaler("mixed", cpu).is_enabled()
    with tu.autocast("mixed", cpu):
        assert torch.nn.Linear(4, 4)(torch.ones(2, 4)).dtype == torch.bfloat16
    with tu.autocast("fp32", cpu):
        assert torch.nn.Linear(4, 4)(torch.ones(2, 4)).dtype == torch.float32


def test_torchrun_command_uses_this_python():
    command = tu.torchrun_command("train.py", 2, "config.json")
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc-per-node=2" in command and command[-2:] == ["train.py", "config.json"]


def test_a_restored_checkpoint_continues_exactly_like_the_uninterrupted_run(tmp_path):
    """Weights, Adam's moments, the schedule's position and the random state all come back."""
    process = tu.Process(0, 1, 0, torch.device("cpu"))

    def build():
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
        parts = dict(
            model=model,
            optimizer=optimizer,
            scaler=torch.amp.GradScaler("cpu", enabled=False),
            scheduler=torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=6),
        )
        return parts

    def train(parts, steps):
        for _ in range(steps):
            loss = parts["model"](torch.randn(8, 4)).pow(2).mean()  # the batch comes from the random state
            parts["optimizer"].zero_grad()
            loss.backward()
            parts["optimizer"].step()
            parts["scheduler"].step()

    torch.manual_seed(0)
    uninterrupted = build()
    train(uninterrupted, 3)
    tu.save_checkpoint(tmp_path, 3, {"EPOCHS": 6}, {"train_loss": [1.0, 0.9, 0.8]}, process, **uninterrupted)
    train(uninterrupted, 3)

    torch.manual_seed(123)  # a new process: other initial weights, another random state
    resumed = build()
    epoch, history = tu.load_checkpoint(checkpoints.complete(tmp_path)[-1], process, **resumed)
    train(resumed, 3)
    assert epoch == 3 and history == {"train_loss": [1.0, 0.9, 0.8]}
    assert resumed["scheduler"].last_epoch == 6
    for name, value in uninterrupted["model"].state_dict().items():
        assert torch.equal(resumed["model"].state_dict()[name], value), name


def test_images_per_second_times_only_the_steps_after_two_warm_ups():
    calls = []
    rate = tu.images_per_second(lambda: calls.append(1), batch_size=8, steps=5, devices=[torch.device("cpu")])
    assert len(calls) == 7 and rate > 0


def test_channels_last_only_where_it_measured_faster():
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert tu.memory_format(gpu, "mixed", tu.CHANNELS_LAST_MIN_BATCH) == torch.channels_last
    assert tu.memory_format(gpu, "mixed", 64) == torch.contiguous_format  # 0.78x as fast at batch 64 on an H200
    assert tu.memory_format(gpu, "fp32", 512) == torch.contiguous_format
    assert tu.memory_format(cpu, "mixed", 512) == torch.contiguous_format


def test_full_batch_leaves_cpu_batches_alone():
    images = torch.ones(3, 3, 8, 8)
    assert tu.full_batch(images, 8) is images


def test_time_steps_records_its_warm_up_and_timed_steps_as_phases():
    phases = Phases()
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 14))
    rate = tu.time_steps(
        model, torch.optim.Adam(model.parameters()), 4, 8, 3, torch.device("cpu"), "fp32", phases=phases
    )
    assert rate > 0 and [row["phase"] for row in phases.rows()] == ["benchmark warm-up", "benchmark"]


def test_precise_bn_replaces_the_running_statistics_by_the_batches_mean():
    model = torch.nn.Sequential(torch.nn.BatchNorm2d(3))
    batches = [(torch.full((2, 1, 4, 4), value, dtype=torch.uint8), None) for value in (10, 30, 200)]
    tu.recompute_batch_norm_statistics(model, batches, 2, torch.device("cpu"), "fp32")
    mean_of_first_two = (20 / 255 - torch.tensor(IMAGENET_MEAN)) / torch.tensor(IMAGENET_STD)  # as the model sees them
    torch.testing.assert_close(model[0].running_mean, mean_of_first_two)


def test_mixed_precision_on_a_gpu_with_emulated_bf16_is_fp16_with_a_loss_scaler(monkeypatch):
    """A T4 or V100 'supports' bf16 by emulation (is_bf16_supported() says yes by default): fp16 with loss scaling
    is what runs fast there, and it needs the scaler that bf16 would not get."""

    def emulated(including_emulation: bool = True) -> bool:
        return including_emulation

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", emulated)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # else GradScaler disables itself on a CPU box
    cuda = torch.device("cuda", 0)
    assert tu.mixed_dtype(cuda) == torch.float16 and tu.mixed_dtype(torch.device("cpu")) == torch.bfloat16
    assert tu.grad_scaler("mixed", cuda).is_enabled() and not tu.grad_scaler("fp32", cuda).is_enabled()
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)  # Ampere and newer
    assert tu.mixed_dtype(cuda) == torch.bfloat16


def test_releasing_memory_empties_the_cuda_cache_once_cuda_is_in_use(monkeypatch):
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    tu.release_memory()  # a CPU process: nothing to give back, and CUDA is not initialized by asking
    assert not emptied
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    tu.release_memory()
    assert emptied == [True]
