"""A wide MLP where memory is the point: its size is one number, and its tensor-parallel plan is one dict.

DenseNet-121 (7M parameters, 28 MB in fp32) fits on any device many times over, so sharding it teaches nothing
about memory. This MLP grows with the square of its width: the notebook picks a width where one full replica with
its gradients and Adam state no longer fits in a device's memory, but a shard still does.

The layers are named ``fc1, relu1, fc2, ...`` so that the tensor-parallel plan names them as PyTorch's TP tutorial
does, and ``depth`` (the number of Linear layers) is even: tensor parallelism pairs a column-wise layer, whose
output stays split across the tensor-parallel ranks, with a row-wise layer that takes that split input and sums
the partial outputs (Megatron-LM's MLP, Shoeybi et al. 2019). The last layer is row-wise, so every rank ends with
the whole logits.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from common.errors import InputError
from common.run.params import NUM_CLASSES


@dataclass(frozen=True)
class MLPShape:
    """``depth`` Linear layers: ``in_features -> width -> ... -> width -> classes``, a ReLU between each two."""

    in_features: int
    width: int
    depth: int = 4
    classes: int = NUM_CLASSES

    def __post_init__(self):
        for name in ("in_features", "width", "depth", "classes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"MLPShape.{name}={value!r}: give a positive whole number.")
        if self.depth % 2:
            raise InputError(
                f"MLPShape.depth={self.depth}: give an even number of Linear layers (2, 4, 6, ...), so that "
                "tensor parallelism can pair each column-wise layer with a row-wise one."
            )

    def arguments(self) -> dict:
        """The shape as keyword arguments (``MLPShape(**shape.arguments())`` rebuilds it), for a launch's config."""
        return {"in_features": self.in_features, "width": self.width, "depth": self.depth, "classes": self.classes}

    @property
    def layers(self) -> list[str]:
        """The Linear layers' names, first to last: the names FSDP wraps one by one and the TP plan uses."""
        return [f"fc{i}" for i in range(1, self.depth + 1)]

    @property
    def linear_sizes(self) -> list[tuple[int, int]]:
        """``(out_features, in_features)`` of each Linear layer: its weight's shape."""
        sizes = [self.in_features] + [self.width] * (self.depth - 1) + [self.classes]
        return [(sizes[i + 1], sizes[i]) for i in range(self.depth)]

    @property
    def parameter_shapes(self) -> list[tuple[int, ...]]:
        """Every parameter's shape, in ``model.parameters()`` order: each layer's weight, then its bias."""
        return [shape for out, inp in self.linear_sizes for shape in ((out, inp), (out,))]

    @property
    def parameters(self) -> int:
        """Ψ, the number of parameters: the ZeRO paper's unit of memory and of communication."""
        return parameter_count(self.width, self.in_features, self.depth, self.classes)

    def build(self, seed: int) -> nn.Sequential:
        """The model with weights drawn from ``seed``: every process and every strategy starts from the same ones."""
        torch.manual_seed(seed)
        layers: list[tuple[str, nn.Module]] = [("flatten", nn.Flatten())]  # images (B, C, H, W) or features (B, F)
        for i, (out, inp) in enumerate(self.linear_sizes, start=1):
            layers.append((f"fc{i}", nn.Linear(inp, out)))
            if i < self.depth:
                layers.append((f"relu{i}", nn.ReLU()))  # not in place: FSDP2's hooks sit on the layers' outputs
        return nn.Sequential(OrderedDict(layers))


def parameter_count(width: int, in_features: int, depth: int = 4, classes: int = NUM_CLASSES) -> int:
    """Weights and biases of :class:`MLPShape` ``(in_features, width, depth, classes)``, without building it.

    ``(depth - 2)`` hidden layers of ``width x width`` dominate: the count grows with the square of the width.
    """
    first = in_features * width + width
    hidden = (depth - 2) * (width * width + width)
    last = width * classes + classes
    return first + hidden + last


def tp_plan(shape: MLPShape) -> dict[str, ColwiseParallel | RowwiseParallel]:
    """The tensor-parallel plan: odd layers column-wise (split output features), even layers row-wise (split input).

    ``ColwiseParallel`` splits the weight's rows (output features) and its bias; its output stays split, and the
    ReLU after it works on each rank's share alone. ``RowwiseParallel`` splits the weight's columns (input
    features), so each rank computes a partial sum of the output: one all-reduce in forward makes it whole, and
    its bias is replicated. Backward mirrors this: the column-wise layer all-reduces its input's gradient, except
    on the first layer, whose input (the data) needs none.
    """
    return {name: ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i, name in enumerate(shape.layers)}


def plan_table(shape: MLPShape, tensor_parallel: int) -> list[dict]:
    """One row per Linear layer: its style, its whole weight, and the weight and bias one TP rank holds."""
    rows = []
    for name, (out, inp), style in zip(shape.layers, shape.linear_sizes, tp_plan(shape).values()):
        column = isinstance(style, ColwiseParallel)
        rows.append(
            {
                "layer": name,
                "style": type(style).__name__,
                "weight": (out, inp),
                "weight per rank": (out // tensor_parallel, inp) if column else (out, inp // tensor_parallel),
                "bias per rank": (out // tensor_parallel,) if column else (out,),
                "bias": "split" if column else "replicated",
            }
        )
    return rows


def check_tensor_parallel(shape: MLPShape, tensor_parallel: int) -> None:
    """Tensor parallelism needs the width to split evenly over the TP ranks: refuse before anything is built.

    DTensor does shard a Linear unevenly (301 rows as 151 + 150), but the next layer's matrix product then fails
    deep in the dispatcher ("a and b must have same reduction dim"), measured with torch 2.14 on gloo.
    """
    if shape.width % tensor_parallel:
        lower = shape.width - shape.width % tensor_parallel
        raise InputError(
            f"Tensor parallelism over {tensor_parallel} ranks splits every hidden layer's {shape.width} features "
            f"evenly: choose a width divisible by {tensor_parallel} (for example {lower or tensor_parallel} "
            f"or {lower + tensor_parallel})."
        )
