"""The helpers every notebook imports, in folders by job and by framework:

- ``data``, ``measure``, ``run``, ``teach``: framework-neutral, importable in every environment, and importing them
  imports no deep-learning framework;
- ``pytorch``, ``tensorflow`` (with Keras), ``mxnet``, ``chainer``: one framework each, importable only in that
  framework's environment (``envs/``, ``make setup``).
"""

from common.errors import InputError

__all__ = ["InputError"]
