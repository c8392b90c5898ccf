#!/usr/bin/env bash
# The Python 3.12 wheels that a GPU machine without network needs for tests/gpu/check.sh (papermill, the Jupyter
# kernel, and pytest with nbval for --tests; Grain, the JAX notebooks' input pipeline, and what it needs beside
# Orbax; Keras 3 for Keras_JAX_MultiGPU), on top of a Python that has torch, torchvision, JAX, Flax, optax, Orbax,
# numpy, pandas, scikit-learn, matplotlib, pillow, psutil, tqdm and nvidia-ml-py. About 28 MB.
#   usage, on a machine that reaches the package index:  tests/gpu/fetch-wheels.sh .gpu-wheels
# Copy the checkout with that folder (keep it out of git, e.g. in .git/info/exclude) to the GPU machine; check.sh
# installs the wheels from there into a temporary folder when it finds no .venv.
set -euo pipefail
dir=${1:?usage: fetch-wheels.sh DIR}
mkdir -p "$dir"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$dir" \
    papermill==2.7.0 nbclient==0.11.0 nbformat==5.11.1 jupyter_client==8.10.0 jupyter_core==5.9.1 \
    ipykernel==7.4.0 ipython==9.18.1 traitlets==5.16.1 tornado==6.6.1 pyzmq==27.3.0 jedi==0.20.1 \
    debugpy==1.8.22 jsonschema==4.26.0 entrypoints==0.4.2 tenacity==9.2.1 fastjsonschema==2.22.3 \
    jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 comm==0.2.3 \
    matplotlib-inline==0.2.2 nest-asyncio2==1.7.4 ipython_pygments_lexers==1.1.1 pexpect==4.9.0 \
    prompt_toolkit==3.0.53 stack-data==0.6.3 parso==0.8.7 ptyprocess==0.7.0 wcwidth==0.9.4 executing==2.3.0 \
    asttokens==3.0.2 pure_eval==0.2.4 platformdirs==4.14.9 nbval==0.11.0 \
    pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 pygments==2.21.0 coverage==7.18.0 \
    array-record==0.8.6 cloudpickle==3.1.3 grain==0.2.18 portpicker==1.6.0 \
    keras==3.15.1 namex==0.1.0 optree==0.20.0 h5py==3.16.0
ls "$dir" | wc -l
