"""PyTorch pieces shared by the PyTorch notebooks: process group, data, model, precision, gathering.

Imported only by PyTorch notebooks and their training scripts (``import common``
does not import torch).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import os
import random
import shlex
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torchvision
from torch import nn
from torch.optim.swa_utils import update_bn
from torchvision.transforms import v2

from common.measure.phases import timed_steps
from common.run import checkpoints, devices, protocol
from common.run.devices import threads_per_device
from common.run.params import CROP_SCALE, IMAGENET_MEAN, IMAGENET_STD, NUM_CLASSES


@dataclass(frozen=True)
class Process:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_devices(requested: int | None) -> devices.Devices:
    """:func:`common.run.devices.resolve`, then a stop, naming the fix, when NVML lists GPUs that this torch cannot
    use (a CUDA build newer than the driver, or a build without CUDA): the workers would train on the CPU instead."""
    hardware = devices.resolve(requested)
    usable = torch.cuda.device_count() if hardware.kind == "gpu" and torch.cuda.is_available() else 0
    devices.require_usable(hardware, f"torch {torch.__version__}", usable, torch.version.cuda)
    return hardware


def this_process() -> Process:
    """This ``torchrun`` process: its rank and world size from the environment ``torchrun`` sets, and its device.

    A GPU process takes the GPU of its local rank (cuDNN autotuning on: the input shapes are fixed). On the CPU
    every process is one simulated device and gets its own share of the cores.
    """
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
    else:
        device = torch.device("cpu")
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or threads_per_device(world_size)))
    return Process(rank, world_size, local_rank, device)


def setup_distributed() -> Process:
    """:func:`this_process`, joined to the process group ``torchrun`` describes: NCCL between GPUs, gloo on the CPU.
    ``PyTorch_MultiGPU`` spells this out; the other launched scripts, whose lesson lies elsewhere, call it."""
    proc = this_process()
    if not dist.is_initialized():
        on_gpu = proc.device.type == "cuda"
        dist.init_process_group("nccl" if on_gpu else "gloo", device_id=proc.device if on_gpu else None)
    return proc


def finish_distributed() -> None:
    """Leave the process group together: a rank that closes its gloo connections while another still uses them
    can abort that one at exit ("terminate called without an active exception")."""
    dist.barrier()
    dist.destroy_process_group()


def torchrun_command(script, nproc: int, *args: str) -> list[str]:
    """``torchrun --standalone`` for one machine."""
    return _torchrun(["--standalone", f"--nproc-per-node={nproc}"], script, args)


def torchrun_multinode_command(
    script, nnodes: int, nproc: int, endpoint: str, run_id: str = "chestxray", *args: str
) -> list[str]:
    """``torchrun`` for one of ``nnodes`` machines: run the same command on each of them.

    The c10d rendezvous meets at ``endpoint`` (``host:port`` of any one node, reachable from all); the
    nodes agree on their ranks there, so no node needs to be told its own rank. ``run_id`` keeps two
    jobs that share an endpoint apart.
    """
    rendezvous = ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}"]
    return _torchrun([f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", *rendezvous], script, args)


def multinode_instructions(script, nnodes: int, nproc: int, config, threads, endpoint: str = "host1:29400") -> str:
    """What to run on each of ``nnodes`` hosts for the run of ``config`` (from
    :func:`common.run.protocol.multinode_config`): the same command everywhere."""
    command = torchrun_multinode_command(script, nnodes, nproc, endpoint, "chestxray", config)
    hosts = " and on ".join(f"host{node + 1}" for node in range(nnodes))
    return (
        f"on {hosts} ({endpoint}: host1's name and a free port that the others can reach):\n"
        f"  OMP_NUM_THREADS={threads} {shlex.join(command)}"
    )


def slurm_script(script, nnodes: int, nproc: int, config, threads, device_kind: str, port: int = 29400) -> str:
    """A Slurm batch script (for ``sbatch``) of the same run on ``nnodes`` nodes: ``srun`` starts one ``torchrun`` per
    node, and they meet at a c10d rendezvous on the job's first node, under the job's id, as PyTorch's multi-node
    examples do. ``threads``: OMP threads per process."""
    if device_kind == "gpu":
        resources = f"#SBATCH --gpus-per-node={nproc}\n#SBATCH --cpus-per-task={nproc * int(threads)}"
    else:
        resources = f"#SBATCH --cpus-per-task={nproc * int(threads)}"
    launcher = _torchrun([f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d"], script, [])
    rendezvous = f'--rdzv-endpoint="$head_node:{port}" --rdzv-id="$SLURM_JOB_ID"'
    lines = [
        "#!/bin/bash",
        "#SBATCH --job-name=chestxray",
        f"#SBATCH --nodes={nnodes}",
        "#SBATCH --ntasks-per-node=1  # one torchrun per node: it starts the node's processes",
        resources,
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"export OMP_NUM_THREADS={threads}",
        f"srun {shlex.join(launcher[:-1])} {rendezvous} {shlex.join([str(script), str(config)])}",
    ]
    return "\n".join(lines) + "\n"


def _torchrun(options: list[str], script, args) -> list[str]:
    """``torchrun`` run by this Python, so it uses this environment."""
    return [sys.executable, "-m", "torch.distributed.run", *options, str(script), *map(str, args)]


def weights_fingerprint(model: nn.Module) -> str:
    """:func:`common.run.protocol.fingerprint` of every parameter and buffer (BatchNorm statistics included)."""
    return protocol.fingerprint((name, tensor.detach().cpu().numpy()) for name, tensor in model.state_dict().items())


def launch_env(nproc: int) -> dict[str, str]:
    """Threads per process: each simulated device (or GPU feeder) gets its own cores."""
    return {"OMP_NUM_THREADS": str(threads_per_device(nproc))}


class ChestXrayDataset(torch.utils.data.Dataset):
    """One image of a :class:`common.data.chestxray.Split` as a 1-channel uint8 tensor, augmented.

    The pixels come from the prepared copy or the PNG (:meth:`~common.data.chestxray.Split.pixels`), the same in every
    framework. They stay uint8 and gray until they are on the device (:func:`to_model_input`): a batch crosses the
    loader's shared memory and the host-to-device copy in a twelfth of the bytes of three float32 channels. Items are
    (image, labels, index); the index lets evaluation drop the duplicates that DistributedSampler pads with.
    """

    def __init__(self, split, transform):
        self.split, self.labels, self.transform = split, torch.as_tensor(split.labels), transform

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, index: int):
        image = torch.from_numpy(self.split.pixels(index)).unsqueeze(0)
        return self.transform(image), self.labels[index], index


def train_transform(image_size: int) -> v2.Compose:
    return v2.Compose([v2.RandomResizedCrop(image_size, scale=CROP_SCALE, antialias=True), v2.RandomHorizontalFlip()])


def eval_transform(image_size: int) -> v2.Compose:
    return v2.Compose([v2.Resize(image_size, antialias=True), v2.CenterCrop(image_size)])


@functools.cache
def _imagenet_statistics(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(torch.tensor(values, device=device).view(1, 3, 1, 1) for values in (IMAGENET_MEAN, IMAGENET_STD))


def to_model_input(
    images: torch.Tensor, device: torch.device, layout: torch.memory_format = torch.contiguous_format
) -> torch.Tensor:
    """A loader's batch of uint8 gray images (N, 1, H, W) as the model's input on ``device``: copied first, then
    scaled to [0, 1], repeated into the three channels that ImageNet-pretrained weights expect and normalized with
    ImageNet's statistics there, in ``layout``."""
    images = images.to(device, non_blocking=True).float().div_(255)
    mean, std = _imagenet_statistics(device)
    return ((images - mean) / std).contiguous(memory_format=layout)  # (N, 1, ...) against (1, 3, ...): 3 channels


def build_densenet121(num_classes: int = NUM_CLASSES, pretrained: bool = False) -> nn.Module:
    """torchvision's DenseNet-121 with a ``num_classes`` output (6,968,206 parameters for 14)."""
    if not pretrained:
        return torchvision.models.densenet121(weights=None, num_classes=num_classes)
    model = torchvision.models.densenet121(weights=torchvision.models.DenseNet121_Weights.DEFAULT)
    model.classifier = nn.Linear(model.classifier.in_features, num_classes)
    return model


def trainable_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def gradient_bytes(model: nn.Module) -> int:
    """What one data-parallel step all-reduces: one gradient per trainable parameter, in the parameter's dtype."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def transfer_bytes(model: nn.Module, image_size: int) -> dict[str, int]:
    """The sizes data parallelism moves between devices, in bytes: ``weights`` (parameters and buffers, which
    DataParallel copies to every replica each step), ``gradients`` (one per trainable parameter), one ``image`` as the
    model takes it (three float32 channels) and its ``output`` (the 14 float32 logits)."""
    float32 = torch.finfo(torch.float32).bits // 8
    return {
        "weights": sum(t.numel() * t.element_size() for t in model.state_dict().values()),
        "gradients": gradient_bytes(model),
        "image": 3 * image_size**2 * float32,
        "output": NUM_CLASSES * float32,
    }


def autocast(precision: str, device: torch.device):
    """bf16 autocast for ``"mixed"`` where the device supports it (fp16 on older GPUs), else nothing."""
    if precision != "mixed":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=mixed_dtype(device))


def native_bf16() -> bool:
    """Whether this GPU computes bf16 itself (Ampere, compute capability 8.0, and newer). ``is_bf16_supported()``
    alone also counts emulation, which a T4 or V100 offers: bf16 there is slow and gets no loss scaler."""
    return torch.cuda.is_bf16_supported(including_emulation=False)


def mixed_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda" and not native_bf16():
        return torch.float16
    return torch.bfloat16


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    """Loss scaling is only needed for fp16; with bf16 or fp32 the scaler is a no-op."""
    enabled = precision == "mixed" and mixed_dtype(device) == torch.float16
    return torch.amp.GradScaler(device.type, enabled=enabled)


# channels_last (NHWC) feeds the tensor cores directly under mixed precision, but it pays only for large batches:
# on an H200 with bf16 autocast, DenseNet-121 trained 1.69x faster in channels_last at batch 256, and at batch 64
# only 0.78x as fast as in the default layout (../shared/gpu: bare_step.py, new_shape_cost.py).
CHANNELS_LAST_MIN_BATCH = 256


def memory_format(device: torch.device, precision: str, batch_size: int) -> torch.memory_format:
    """channels_last where it measured faster (mixed precision on a GPU, large batches), else the default layout."""
    if device.type == "cuda" and precision == "mixed" and batch_size >= CHANNELS_LAST_MIN_BATCH:
        return torch.channels_last
    return torch.contiguous_format


def full_batch(images: torch.Tensor, batch_size: int) -> torch.Tensor:
    """``images`` padded with zero images to ``batch_size`` on a GPU: each new batch shape costs cuDNN another round
    of autotuning (seconds for evaluation), while the training shape's kernels are already chosen."""
    if images.device.type != "cuda" or len(images) >= batch_size:
        return images
    layout = torch.channels_last if images.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format
    padded = images.new_zeros((batch_size, *images.shape[1:])).contiguous(memory_format=layout)
    padded[: len(images)] = images
    return padded


@torch.no_grad()
def predict_all(
    model: nn.Module,
    loader,
    process: Process,
    precision: str,
    layout: torch.memory_format = torch.contiguous_format,
) -> tuple[np.ndarray, np.ndarray]:
    """Sigmoid scores and labels of the whole data set, gathered from every rank, in data set order.

    Each rank scores its shard; DistributedSampler pads the shards to equal length by repeating images, so
    duplicates are dropped by index. The images take the training's memory ``layout`` and batch shape, so
    evaluation reuses the kernels that training chose.
    """
    model.eval()
    scores, labels, indices = [], [], []
    for images, targets, index in loader:
        images = to_model_input(images, process.device, layout)
        with autocast(precision, process.device):
            logits = model(full_batch(images, loader.batch_size))[: len(images)]
        scores.append(torch.sigmoid(logits.float()))
        labels.append(targets.to(process.device))
        indices.append(index.to(process.device))
    local = torch.cat([torch.cat(indices).unsqueeze(1).float(), torch.cat(labels), torch.cat(scores)], dim=1)
    if process.world_size > 1:
        gathered = [torch.empty_like(local) for _ in range(process.world_size)]
        dist.all_gather(gathered, local)
        local = torch.cat(gathered)
    table = local.cpu().numpy()
    _, first = np.unique(table[:, 0].astype(np.int64), return_index=True)
    table = table[first]
    model.train()
    return table[:, 1 : 1 + NUM_CLASSES], table[:, 1 + NUM_CLASSES :]


@torch.no_grad()
def recompute_batch_norm_statistics(
    model: nn.Module,
    loader,
    batches: int,
    device: torch.device,
    precision: str,
    layout: torch.memory_format = torch.contiguous_format,
) -> None:
    """ "Precise BN": the mean statistics of ``batches`` batches of ``loader`` replace the running averages
    (``torch.optim.swa_utils.update_bn``), computed as training computes: the same precision and memory layout."""
    images = (to_model_input(batch[0], device, layout) for batch in itertools.islice(loader, batches))
    with autocast(precision, device):
        update_bn(images, model, device)


@torch.no_grad()
def share_batch_norm_statistics(model: nn.Module, process: Process) -> None:
    """Average the BatchNorm running statistics over all ranks, so every rank scores images alike.

    DDP copies rank 0's buffers to the other ranks only before a forward pass with gradients enabled,
    not under ``torch.no_grad()``: without this, each rank would evaluate its shard with the statistics
    of its own batches (and after the last training step each rank's differ by its own last batch).
    """
    if process.world_size == 1:
        return
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    buffers = [buffer for m in norms for buffer in (m.running_mean, m.running_var)]
    flat = torch.cat([buffer.reshape(-1) for buffer in buffers])  # one all-reduce, not 242
    dist.all_reduce(flat)
    flat /= process.world_size
    for buffer, shared in zip(buffers, flat.split([buffer.numel() for buffer in buffers])):
        buffer.copy_(shared.view_as(buffer))


def optimizer_step(loss_of, images, labels, optimizer, scaler, precision: str, device) -> torch.Tensor:
    """One training step, ``loss_of(images, labels)`` giving the loss; returns it without waiting (no host sync)."""
    with autocast(precision, device):
        loss = loss_of(images, labels)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss.detach()


def optimizer_step_of(loss_of, optimizer, precision: str, device):
    """``step(images, labels)``: :func:`optimizer_step` with a loss scaler of its own, for
    :func:`common.pytorch.training.fit`."""
    scaler = grad_scaler(precision, device)
    return lambda images, labels: optimizer_step(loss_of, images, labels, optimizer, scaler, precision, device)


def images_per_second(step, batch_size: int, steps: int, devices, phases=None) -> float:
    """Throughput of ``steps`` calls of ``step()``, after two untimed warm-up calls (allocation, cuDNN autotuning).

    ``devices``: every device the step computes on (all GPUs of a DataParallel step), and no other, so the
    clock stops when their queued work is done without creating a CUDA context on a GPU the step never used.
    ``phases`` (a :class:`common.measure.phases.Phases`) gets the warm-up and the timed steps.
    """
    return steps * batch_size / timed_steps(step, steps, lambda _: synchronize(devices), phases)


def release_memory() -> None:
    """Give the GPU memory that this process's caching allocator keeps back to the driver. A notebook's kernel lives
    on after its own GPU work (a check, a measurement, an evaluation), and the processes it launches next need the
    memory; they cannot take what the kernel's allocator holds."""
    gc.collect()  # autograd graphs and closures in reference cycles hold tensors until collected
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def synchronize(devices) -> None:
    """Wait for the queued work of each CUDA device in ``devices`` (``torch.device``s or GPU indices)."""
    for device in devices:
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)


def time_steps(
    model: nn.Module,
    optimizer,
    batch_size: int,
    image_size: int,
    steps: int,
    device,
    precision: str,
    layout: torch.memory_format = torch.contiguous_format,
    phases=None,
) -> float:
    """Images per second of all processes together: ``steps`` training steps on one fixed random batch held in
    device memory, ``batch_size`` images in each of the process group's processes (or in this one). The batch is
    uint8 gray, as the loaders send it: each step makes it the model's input on the device, as training does."""
    images = torch.randint(0, 256, (batch_size, 1, image_size, image_size), dtype=torch.uint8, device=device)
    targets = torch.randint(0, 2, (batch_size, NUM_CLASSES), device=device).float()
    loss_fn = nn.BCEWithLogitsLoss()
    scaler = grad_scaler(precision, device)

    def step():
        return optimizer_step(
            lambda x, y: loss_fn(model(to_model_input(x, device, layout)).float(), y),
            images, targets, optimizer, scaler, precision, device,
        )  # fmt: skip

    processes = dist.get_world_size() if dist.is_initialized() else 1
    return processes * images_per_second(step, batch_size, steps, [device], phases)


def rng_state(device: torch.device) -> dict:
    """Every random generator a training process draws from: torch (and CUDA), numpy, Python."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"], device)
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def save_checkpoint(folder, epoch: int, settings: dict, history: dict, process: Process, **parts) -> None:
    """Rank 0 writes the checkpoint of ``epoch`` (the ``state_dict`` of each part, every rank's RNG state).

    Every rank waits until it is complete, so none runs ahead of a checkpoint that a kill could still lose.
    """
    states = [rng_state(process.device)]
    if process.world_size > 1:
        states = [None] * process.world_size
        dist.all_gather_object(states, rng_state(process.device))
    if process.is_main:
        payload = {name: part.state_dict() for name, part in parts.items()}
        payload.update(epoch=epoch, rng=states, history=history)
        checkpoints.save(folder, epoch, ".pt", lambda path: torch.save(payload, path), settings, history)
    if process.world_size > 1:
        dist.barrier()


def load_checkpoint(checkpoint: checkpoints.Checkpoint, process: Process, **parts) -> tuple[int, dict]:
    """Restore each part and this rank's RNG state; returns the epochs finished and the history."""
    # our own file; it holds numpy's RNG state too
    saved = torch.load(checkpoint.state, map_location="cpu", weights_only=False)
    for name, part in parts.items():
        part.load_state_dict(saved[name])
    set_rng_state(saved["rng"][process.rank], process.device)
    return saved["epoch"], saved["history"]
