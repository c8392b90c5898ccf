"""Framework-neutral helpers shared by every notebook.

Importing ``common`` (or any of the modules listed here) never imports a
deep-learning framework: framework-specific helpers live in their own modules
(``common.torch_utils``, ...) and are imported only by the notebooks that need them.
"""

from common.errors import InputError

__all__ = ["InputError"]
