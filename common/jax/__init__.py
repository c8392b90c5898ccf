"""JAX pieces of the JAX notebook: imported only there (``import common`` does not import JAX)."""
