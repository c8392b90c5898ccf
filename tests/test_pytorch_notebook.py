"""The PyTorch reference notebook, executed headless with papermill on 1 and 2 simulated CPU devices."""

from notebook_harness import NotebookContract


class TestPyTorchNotebook(NotebookContract):
    NOTEBOOK = "PyTorch_MultiGPU"
    FRAMEWORK = "pytorch"
    MULTI_MACHINE = "config-2-nodes.json"
