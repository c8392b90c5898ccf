"""Chainer and ChainerMN helpers: importable only in the ``mxnet-chainer`` environment (kernel
``multigpu-mxnet-chainer``). Import Chainer through ``common.chainer.imports``."""
