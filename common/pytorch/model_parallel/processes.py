"""Processes that work as a world of one, outside any process group.

The first pipeline stage reads the whole data set through one (:func:`single_process`), each process of the
one-model-per-device sweep trains alone (:func:`independent_process`), and the notebook's own process evaluates
the model assembled from the stages (:func:`evaluate_assembled`).
"""

from __future__ import annotations

import itertools
import os

import torch
from torch import nn
from torch.optim.swa_utils import update_bn

from common.pytorch import training as tt
from common.pytorch import utils as tu
from common.run.devices import threads_per_device


def single_process(device: torch.device) -> tu.Process:
    """A process that trains on its own, as rank 0 of a world of one: its loaders read the whole data set."""
    return tu.Process(0, 1, 0, device)


def independent_process() -> tu.Process:
    """One process of a ``torchrun`` launch that trains alone: its own GPU (or its share of the cores), no group.

    ``torchrun`` is only the launcher here: it starts the processes together, streams their output and
    fails if any fails; the processes never talk to each other.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or threads_per_device(1)))
    return tu.Process(0, 1, local_rank, device)


def evaluate_assembled(
    model: nn.Module,
    splits,
    *,
    image_size: int,
    batch: int,
    precision: str,
    seed: int,
    batch_norm_batches: int,
    device: torch.device,
    workers: int = 0,
):
    """Precise BN from training batches, then sigmoid scores and labels of every test image once, in order.

    Runs in the notebook's own process on one device: the assembled model is an ordinary DenseNet-121 again.
    """
    process = single_process(device)
    model.to(device).train()
    train = tt.sharded_loader(
        splits["train"], tu.train_transform(image_size), batch, process, shuffle=True, seed=seed, workers=workers
    )
    with torch.no_grad():
        update_bn(
            (tu.to_model_input(images, device) for images, *_ in itertools.islice(train, batch_norm_batches)),
            model,
            device,
        )
    test = tt.sharded_loader(
        splits["test"], tu.eval_transform(image_size), batch, process, shuffle=False, seed=seed, workers=workers
    )
    scored = tu.predict_all(model, test, process, precision)
    model.to("cpu")  # the notebook's kernel keeps the model; the benchmark launched next needs the device's memory
    tu.release_memory()
    return scored
