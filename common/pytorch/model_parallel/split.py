"""The cut: DenseNet-121 as two stages sharing its parameters, back to one model, and naive model parallelism.

The model is cut between dense blocks, where a single tensor crosses the cut, so each stage is an ordinary
``nn.Module`` and a pipeline only ever sends that tensor forward and its gradient back.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from common.pytorch import utils as tu

# Stage 0 ends with transition2, stage 1 starts at denseblock3. Only a 256-channel map at 1/16 of the image
# size crosses the cut (16 KiB per 64-px image in fp32), and no earlier layer's output is needed after it.
SPLIT_AT = "denseblock3"
STAGES = 2  # pipeline and naive model parallelism here use exactly two devices


class Stage(nn.Module):
    """A run of DenseNet-121's ``features``, and on the last stage the head (ReLU, global pool, classifier).

    The submodules keep the names they have in the whole model, so the stages' state dicts together are
    exactly the whole model's state dict (see :func:`merge_states`).
    """

    def __init__(self, model: nn.Module, names: list[str], head: bool):
        super().__init__()
        self.features = nn.Sequential(OrderedDict((name, getattr(model.features, name)) for name in names))
        self.classifier = model.classifier if head else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        if self.classifier is None:
            return x
        # the tail of torchvision's DenseNet.forward, step for step, so the two stages equal the whole model
        x = F.relu(x, inplace=True)
        x = F.adaptive_avg_pool2d(x, (1, 1))
        return self.classifier(torch.flatten(x, 1))


def split_densenet(model: nn.Module, at: str = SPLIT_AT) -> list[Stage]:
    """Two stages that share ``model``'s parameters: ``features`` before ``at``, and the rest with the head."""
    names = [name for name, _ in model.features.named_children()]
    if at not in names[1:]:
        raise ValueError(f"cannot split DenseNet-121 at {at!r}: choose one of {names[1:]}")
    cut = names.index(at)
    return [Stage(model, names[:cut], head=False), Stage(model, names[cut:], head=True)]


def parameters_per_stage(stages) -> list[int]:
    return [tu.trainable_parameters(stage) for stage in stages]


def merge_states(states) -> dict[str, torch.Tensor]:
    """The whole model's state dict from the stages' (on the CPU); the stages must not overlap."""
    merged = {}
    for state in states:
        overlap = merged.keys() & state.keys()
        if overlap:
            raise ValueError(f"stages overlap in {sorted(overlap)[:3]}")
        merged.update({name: value.cpu() for name, value in state.items()})
    return merged


def build_stages(seed: int, pretrained: bool = False) -> list[Stage]:
    """The stages of a freshly built DenseNet-121; the same seed gives every process the same initial weights."""
    torch.manual_seed(seed)
    return split_densenet(tu.build_densenet121(pretrained=pretrained))


class NaiveModelParallel(nn.Module):
    """Each stage on its own device, run one after the other in one process.

    The activation is copied from one device to the next at the cut; while one device computes, the other
    waits, so two devices give the memory of two but the speed of one (less, counting the copies).
    """

    def __init__(self, stages, devices):
        super().__init__()
        self.devices = [torch.device(device) for device in devices]
        self.stages = nn.ModuleList(stage.to(device) for stage, device in zip(stages, self.devices))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage, device in zip(self.stages, self.devices):
            x = stage(x.to(device, non_blocking=True))
        return x
