"""torchvision's DenseNet-121 with non-trivial BatchNorm statistics, and what it computes, for a framework in another
environment to copy and compare (``tests/mxnet_chainer/test_chainer_utils.py``).

    python densenet_reference.py OUT.npz

Writes each layer's arrays in the order the model's layers run (``<i>/weight``, ``<i>/bias``, ``<i>/running_mean``,
``<i>/running_var``; ``kinds`` names each layer ``conv``, ``norm`` or ``linear``), a batch of ``images`` and the
model's ``eval`` and ``train`` outputs for it.
"""

import sys

import numpy as np
import torch
import torchvision

from common.run.params import NUM_CLASSES


def layers_in_order(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The convolutions, BatchNorms and the classifier, a dense layer as norm1, conv1, norm2, conv2."""
    found = [model.features.conv0, model.features.norm0]
    for block in list(model.features.children())[4:-1]:  # after pool0, before norm5
        if isinstance(block, torchvision.models.densenet._DenseBlock):
            for layer in block.children():
                found += [layer.norm1, layer.conv1, layer.norm2, layer.conv2]
        else:
            found += [block.norm, block.conv]
    return [*found, model.features.norm5, model.classifier]


def main(out: str) -> None:
    torch.manual_seed(0)
    model = torchvision.models.densenet121(weights=None, num_classes=NUM_CLASSES)
    rng = np.random.default_rng(0)
    arrays, kinds = {}, []
    for index, layer in enumerate(layers_in_order(model)):
        if isinstance(layer, torch.nn.BatchNorm2d):  # non-trivial statistics and affine parameters
            for name in ("weight", "bias", "running_mean"):
                getattr(layer, name).data = torch.tensor(rng.normal(0, 0.2, layer.num_features), dtype=torch.float32)
            layer.running_var.data = torch.tensor(rng.uniform(0.5, 1.5, layer.num_features), dtype=torch.float32)
        kinds.append({torch.nn.Conv2d: "conv", torch.nn.BatchNorm2d: "norm", torch.nn.Linear: "linear"}[type(layer)])
        for name, tensor in [*layer.named_parameters(), *layer.named_buffers()]:
            if name != "num_batches_tracked":  # a copy: the train-mode pass below updates the statistics in place
                arrays[f"{index}/{name}"] = tensor.detach().numpy().copy()
    images = rng.standard_normal((4, 3, 64, 64)).astype(np.float32)
    outputs = {}
    with torch.no_grad():
        for mode in ("eval", "train"):
            model.train(mode == "train")
            outputs[mode] = model(torch.from_numpy(images)).numpy()
    np.savez(out, kinds=np.array(kinds), images=images, **outputs, **arrays)


if __name__ == "__main__":
    main(sys.argv[1])
