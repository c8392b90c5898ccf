"""PyTorch helpers: importable only in the ``pytorch`` environment (``.venvs/pytorch``, kernel ``multigpu-pytorch``)."""
