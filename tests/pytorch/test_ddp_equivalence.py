"""Data-parallel sync: one DDP step on 2 gloo ranks equals one step on 1 rank with the same global batch."""

import gloo_ranks
import torch
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

GLOBAL_BATCH = 8


def make_model(batch_norm: bool) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 4, 3, padding=1)]
    if batch_norm:
        layers.append(nn.BatchNorm2d(4))
    layers += [nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 14)]
    return nn.Sequential(*layers)


def make_batch():
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(GLOBAL_BATCH, 3, 8, 8, generator=generator)
    labels = torch.randint(0, 2, (GLOBAL_BATCH, 14), generator=generator).float()
    return images, labels


def one_step(model, images, labels) -> dict[str, torch.Tensor]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = nn.functional.binary_cross_entropy_with_logits(model(images), labels)
    loss.backward()
    optimizer.step()
    module = model.module if isinstance(model, DistributedDataParallel) else model
    return {name: value.detach().clone() for name, value in module.state_dict().items()}


def rank_main(rank: int, world_size: int, port: int, batch_norm: bool, out: str) -> None:
    process = gloo_ranks.join(rank, world_size, port)  # the notebooks' own process-group setup
    images, labels = make_batch()
    share = GLOBAL_BATCH // world_size  # every rank gets its own slice of the global batch
    rows = slice(rank * share, (rank + 1) * share)
    model = DistributedDataParallel(make_model(batch_norm))
    state = one_step(model, images[rows], labels[rows])
    torch.save(state, f"{out}.rank{rank}")
    torch.distributed.destroy_process_group()
    assert process.world_size == world_size


def ddp_states(tmp_path, batch_norm: bool, world_size: int = 2):
    out = str(tmp_path / "state")
    mp.spawn(rank_main, args=(world_size, gloo_ranks.free_port(), batch_norm, out), nprocs=world_size, join=True)
    return [torch.load(f"{out}.rank{rank}") for rank in range(world_size)]


def test_two_ranks_take_the_same_step_as_one_device(tmp_path):
    reference = one_step(make_model(batch_norm=False), *make_batch())
    states = ddp_states(tmp_path, batch_norm=False)
    for state in states:
        for name, value in reference.items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=f"{name} differs")
    # the step really moved the weights, so equality is not trivial
    assert not torch.allclose(reference["0.weight"], make_model(batch_norm=False).state_dict()["0.weight"])


def test_batch_norm_statistics_stay_per_replica(tmp_path):
    """The known exception: each replica normalizes with, and keeps, the statistics of its own share."""
    reference = one_step(make_model(batch_norm=True), *make_batch())
    rank0, rank1 = ddp_states(tmp_path, batch_norm=True)
    assert not torch.allclose(rank0["1.running_mean"], reference["1.running_mean"], atol=1e-4)
    assert not torch.allclose(rank0["1.running_mean"], rank1["1.running_mean"], atol=1e-4)
    # gradients are still averaged, so the trained weights agree across replicas
    torch.testing.assert_close(rank0["5.weight"], rank1["5.weight"])
