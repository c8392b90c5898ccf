#!/usr/bin/env bash
# GPU check: the notebooks briefly on this machine's NVIDIA GPUs, and with --tests the PyTorch part of the test suite.
#
#   tests/gpu/check.sh            the notebooks, each within its own time cap
#   tests/gpu/check.sh --tests    then pytest (papermill and nbval included) on the PyTorch tests, on the GPU
#   tests/gpu/check.sh --plan     say what it would run here (GPUs, data, notebooks, skips, cap), and stop
#
# What it checks: each notebook whose framework is installed runs end to end on the GPU code path at DEVICES=1 and,
# with more than one GPU, at DEVICES=<all GPUs> (the two placement notebooks once, on all GPUs; PyTorch_ModelParallel
# needs two), with PRECISION="mixed" at 64 images per GPU, for two epochs on a generated stand-in at 224 px sized from
# the GPU count so that every run takes several steps (4 or more per epoch at 8 GPUs), then its synthetic-data
# benchmark (20 timed steps). Each notebook has its own time cap (CHECK_NOTEBOOK_SECONDS, 150 by default): one that
# hangs is stopped and named, and the others still run. A notebook that fails is listed and makes the script exit
# non-zero. It prints, per run, training and in-RAM images/s and the peak memory of every GPU, then where each run's
# time went (the phases of its record).
# What it does not check: accuracy (two epochs from scratch), multi-node launches, or speed against any threshold.
#
# The Pythons: the environments of `make setup GPU=1` (.venvs/: the tools run the notebooks, each in its own
# environment's kernel); otherwise this machine's python3, which needs torch and torchvision, and finds papermill, the
# Jupyter kernel, pytest and nbval in the wheels of tests/gpu/fetch-wheels.sh (fetched where the network is, in
# .gpu-wheels/ of this checkout): it becomes the kernel of every environment whose framework it can import. The
# notebooks of an environment that is not there (TensorFlow, MXNet, Chainer on such a machine) are skipped, each with a
# line that says so, and so is Gluon on GPUs of compute capability 9.0 or newer, for which MXNet has no kernels.
# Without a GPU the script says so and exits 0.
set -euo pipefail
cd "$(dirname "$0")/../.."

if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    echo "tests/gpu/check.sh: skipped, no NVIDIA GPU here (nvidia-smi lists none)"
    exit 0
fi

if [ -x .venvs/tools/bin/python ]; then
    PY=.venvs/tools/bin/python
else
    PY=python3
    scratch=$(mktemp -d)
    if [ -d .gpu-wheels ]; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$scratch/site" .gpu-wheels/*.whl
        export PATH="$scratch/site/bin:$PATH" PYTHONPATH="$scratch/site"
    fi
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    for environment_module in pytorch:torch tensorflow:tensorflow mxnet-chainer:mxnet jax:jax; do
        if "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('${environment_module#*:}') is None)"
        then
            "$PY" -m common.run.kernel --environment "${environment_module%%:*}" --prefix "$scratch/jupyter" >/dev/null
        fi
    done
    export JUPYTER_PATH="$scratch/jupyter/share/jupyter"
fi
export MPLBACKEND=Agg PYTHONUNBUFFERED=1
echo "python: $("$PY" -c 'import sys; print(sys.version.split()[0])') ($PY)"

# the notebooks whose environment's kernel is here (the others are named by common.run), but Gluon on Hopper and newer
capability=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | sort -n | head -1)
notebooks=(PyTorch_MultiGPU PyTorch_MultiGPU-Exp-Loss PyTorch_ModelParallel DataParallel_From_Scratch PyTorch_Sharded
    JAX_MultiGPU Keras_JAX_MultiGPU Tensorflow_MultiGPU Keras_TF_MultiGPU Chainer_MultiGPU)
if [ "${capability%%.*}" -ge 9 ]; then
    echo "Gluon_MultiGPU: skipped, MXNet has no kernels for compute capability $capability (its wheels stop at sm_86)"
else
    notebooks+=(Gluon_MultiGPU)
fi

out="runs/gpu-check-$(date +%Y%m%d-%H%M%S)"
gpus=$(nvidia-smi -L | grep -c '^GPU')
batch=64
# 4 steps per epoch at the most GPUs (each notebook refuses fewer than one), and never fewer than 1,200 images
images=$("$PY" -c "from common.run import params; print(max(1200, params.images_for_steps(4, $batch * $gpus)))")
cap=${CHECK_NOTEBOOK_SECONDS:-150}
echo "$gpus GPU(s): $images generated images, $batch per GPU; ${notebooks[*]}, each within $cap s"
if [ "${1:-}" = "--plan" ]; then
    exit 0
fi
data=$("$PY" -c "from common.data import synthetic; print(synthetic.ensure(n_images=$images, image_size=256))")
status=0
for notebook in "${notebooks[@]}"; do
    code=0
    timeout --kill-after 20 "$cap" "$PY" -m common.run --data-dir "$data" --out "$out" --notebooks "$notebook" \
        -p EPOCHS 2 -p IMAGE_SIZE 224 -p MAX_IMAGES "$images" -p BATCH_SIZE_PER_DEVICE "$batch" -p BENCH_STEPS 20 \
        -p PRECISION mixed || code=$?
    if [ "$code" -eq 124 ] || [ "$code" -eq 137 ]; then
        echo "tests/gpu/check.sh: $notebook took longer than its $cap s; see $out/executed/" >&2
    fi
    [ "$code" -eq 0 ] || status=1
done

"$PY" - "$out" <<'PY'
import sys

import pandas as pd

from common.measure import report, results

records = results.load_all(f"{sys.argv[1]}/results")
rows = []
for record in records:
    memory = {device: value["memory_peak_mib"] for device, value in record["device_utilization"].items()}
    rows.append({"notebook": results.label(record), "devices": record["devices"], "data": record["data"],
                 "batch/device": record["global_batch"] // record["devices"], "images/s": round(record["images_per_second"], 1),
                 "peak MiB per GPU": " ".join(f"{device}:{mib:.0f}" for device, mib in sorted(memory.items()))})
pd.set_option("display.width", 200)
if rows:
    print(pd.DataFrame(rows).sort_values(["notebook", "devices", "data"]).to_string(index=False), "\n")
    print("seconds per phase:")
    print(report.phase_table(records).round(1).to_string(), "\n")
    from common.measure import phases

    for (notebook, devices), record in report.newest_runs(records).items():
        print(f"{notebook} on {devices} device(s): {phases.outside_steps(record['phases']):.1f} s"
              " outside the steps (the goal on one H200, for 5 epochs of the 20,000-image stand-in: 15 s)")
print(f"records and executed notebooks: {sys.argv[1]}")
PY

if [ "${1:-}" = "--tests" ]; then
    # the PyTorch part of the suite: the PyTorch notebooks under papermill and nbval, and what they are built from
    TORCH_PY=$([ -x .venvs/pytorch/bin/python ] && echo .venvs/pytorch/bin/python || echo "$PY")
    timeout --kill-after 20 900 "$PY" -m pytest -p no:cacheprovider -q --durations=10 tests/test_gpu_notebooks.py \
        tests/test_protocol.py tests/test_phases.py tests/test_params.py tests/test_devices.py tests/test_results.py \
        tests/test_structure.py || status=$?
    timeout --kill-after 20 600 "$TORCH_PY" -m pytest -p no:cacheprovider -q --durations=10 \
        tests/pytorch/test_torch_utils.py tests/pytorch/test_torch_training.py || status=$?
fi
exit "$status"
