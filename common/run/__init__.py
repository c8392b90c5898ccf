"""Running the notebooks: their parameters and devices, the environments and kernels they run in, launching
training processes and what those hand back, checkpoints, the cell-order check, and ``python -m common.run`` (all
notebooks headless with papermill). Framework-neutral: importable in every environment."""
