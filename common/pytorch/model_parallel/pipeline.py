"""The GPipe pipeline's shared parts: the stage wrapper and the loss its schedule calls, and the batches it is fed.

The pipeline itself (``PipelineStage``, ``ScheduleGPipe``, ``schedule.step``) is on the page, in the script that
``PyTorch_ModelParallel`` launches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from common.pytorch import utils as tu
from common.run.params import NUM_CLASSES


class Autocast(nn.Module):
    """Runs a stage under ``tu.autocast``: the pipeline schedule calls the stage, so the context must be inside."""

    def __init__(self, module: nn.Module, precision: str, device: torch.device):
        super().__init__()
        self.module, self.precision, self.device = module, precision, device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with tu.autocast(self.precision, self.device):
            return self.module(x)


def bce_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean binary cross-entropy of every notebook, computed in fp32 whatever the precision of the logits."""
    return F.binary_cross_entropy_with_logits(logits.float(), labels)


def random_batch(batch: int, image_size: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed batch of noise images and 0/1 labels, the same in every process that uses the same seed."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, 3, image_size, image_size, generator=generator)
    labels = torch.randint(0, 2, (batch, NUM_CLASSES), generator=generator).float()
    return images.to(device), labels.to(device)


def labels_loader(split, batch_size: int, seed: int) -> DataLoader:
    """The labels of ``split`` in the order a shuffled single-process ``sharded_loader`` reads the images.

    The last pipeline stage needs only the labels: the same sampler (same seed, same epoch) gives the same
    batches without decoding a single image.
    """
    data = TensorDataset(torch.as_tensor(split.labels).float(), torch.arange(len(split)))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=seed, drop_last=False)
    return DataLoader(data, batch_size=batch_size, sampler=sampler, drop_last=True)
