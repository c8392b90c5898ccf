"""One training step of a small model under ChainerMN's ``naive`` communicator, on however many MPI ranks it runs.

Run by ``test_chainer_utils.py`` as ``mpiexec -n N python chainer_replicas.py OUT.npz`` for N = 1 and 2: rank 0 writes
every rank's weights after each variant of the step, under keys ``variant/rank/name``. ``... chainer_replicas.py fail``
makes rank 1 raise while rank 0 waits for it in an all-reduce.
"""

import sys

import numpy as np

from common.chainer import utils as cu
from common.chainer.imports import chainer, chainermn

GLOBAL_BATCH = 8
F, L = chainer.functions, chainer.links


class Small(chainer.Chain):
    """Convolution, (BatchNorm,) ReLU, global average pool, linear: the notebook's model in miniature."""

    def __init__(self, batch_norm: bool = False):
        super().__init__()
        rng = np.random.default_rng(0)  # the same start on every rank without any broadcast
        with self.init_scope():
            self.conv = L.Convolution2D(3, 4, 3, pad=1, initialW=rng.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32))
            if batch_norm:  # as the notebook's BatchNorm: PyTorch's momentum and eps
                self.norm = L.BatchNormalization(4, decay=cu.BATCH_NORM_MOMENTUM, eps=cu.BN_EPS)
            self.fc = L.Linear(4, 14, initialW=rng.normal(0, 0.3, (14, 4)).astype(np.float32))
        self.batch_norm = batch_norm

    def forward(self, x):
        h = self.conv(x)
        if self.batch_norm:
            h = self.norm(h, finetune=getattr(chainer.config, "precise_bn", False))
        return self.fc(F.mean(F.relu(h), axis=(2, 3)))


def make_batch():
    rng = np.random.default_rng(1)
    images = rng.standard_normal((GLOBAL_BATCH, 3, 8, 8)).astype(np.float32)
    labels = rng.integers(0, 2, (GLOBAL_BATCH, 14)).astype(np.int32)
    return images, labels


def one_step(comm, optimizer, batch_norm=False, divide_by_global_batch=False):
    """The notebook script's step on this rank's slice of the global batch; returns the model after it."""
    model = Small(batch_norm)
    optimizer = chainermn.create_multi_node_optimizer(optimizer, comm)
    optimizer.setup(model)
    optimizer.update()  # as in the notebook: ChainerMN's first update only broadcasts rank 0's weights
    share = GLOBAL_BATCH // comm.size
    rows = slice(comm.rank * share, (comm.rank + 1) * share)
    images, labels = make_batch()
    loss = cu.sigmoid_loss(model(images[rows]), labels[rows])  # the mean over this rank's images
    if divide_by_global_batch:  # right where gradients are summed (tf.distribute); ChainerMN averages them
        loss = loss * share / GLOBAL_BATCH
    model.cleargrads()
    loss.backward()
    optimizer.update()
    return model


def weights(model) -> dict[str, np.ndarray]:
    return {name: param.array.copy() for name, param in model.namedparams()}


def main(out: str) -> None:
    chainermn.global_except_hook.add_hook()  # as the notebook's script: an exception aborts every rank
    comm = chainermn.create_communicator("naive")
    if out == "fail":
        if comm.rank == 1:
            raise RuntimeError("rank 1 fails on purpose")
        comm.allreduce_obj(1.0)  # rank 0 would wait here for ever without the hook above
        return
    states = {
        "initial": weights(Small()),
        "sgd": weights(one_step(comm, chainer.optimizers.SGD(lr=0.5))),
        "sgd_divided_by_global_batch": weights(
            one_step(comm, chainer.optimizers.SGD(lr=0.5), divide_by_global_batch=True)
        ),
        "adam": weights(one_step(comm, chainer.optimizers.Adam(alpha=0.01))),
    }
    model = one_step(comm, chainer.optimizers.SGD(lr=0.5), batch_norm=True)
    states["bn_trained"] = weights(model)
    states["bn_own"] = {"avg_mean": model.norm.avg_mean.copy(), "avg_var": model.norm.avg_var.copy()}
    cu.share_batch_norm_statistics(model, comm)
    states["bn_shared"] = {"avg_mean": model.norm.avg_mean.copy(), "avg_var": model.norm.avg_var.copy()}
    share = GLOBAL_BATCH // comm.size
    images = make_batch()[0][comm.rank * share : (comm.rank + 1) * share]
    used = cu.recompute_batch_norm_statistics(model, [images[: share // 2], images[share // 2 :]], comm)
    states["bn_recomputed"] = {"avg_mean": model.norm.avg_mean.copy(), "batches": np.array(used)}
    gathered = comm.gather_obj(states)
    if comm.rank == 0:
        flat = {
            f"{variant}/{rank}/{name}": value
            for rank, state in enumerate(gathered)
            for variant, arrays in state.items()
            for name, value in arrays.items()
        }
        np.savez(out, **flat)


if __name__ == "__main__":
    main(sys.argv[1])
