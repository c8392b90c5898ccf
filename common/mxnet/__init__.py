"""MXNet Gluon helpers: importable only in the ``mxnet-chainer`` environment (kernel ``multigpu-mxnet-chainer``).
Import MXNet through ``common.mxnet.imports``."""
