#!/usr/bin/env bash
# GPU check: every notebook, briefly, on this machine's NVIDIA GPUs.
#
# What it checks: each notebook in notebooks/ runs end to end on the GPU code path at DEVICES=1 and, with more than
# one GPU, at DEVICES=<all GPUs> (the two placement notebooks once, on all GPUs; PyTorch_ModelParallel needs two),
# with PRECISION="mixed" (bf16 or fp16 per framework and GPU), for one epoch on a
# 1,200-image generated stand-in at 224 px, then its synthetic-data benchmark (20 timed steps). A notebook that
# fails is listed and makes the script exit non-zero. It records training and in-RAM images/s and the peak memory of
# every GPU per framework into one results folder (runs/gpu-check-<time>/) and prints them as a table.
# What it does not check: accuracy (one epoch from scratch), multi-node launches, or speed against any threshold.
#
# Budget: the runs must finish within 8 minutes on one modern GPU (a hard timeout of 480 s). The first
# `make setup GPU=1` that installs the CUDA builds is not part of it. Without a GPU the script says so and exits 0.
set -euo pipefail
cd "$(dirname "$0")/../.."

if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    echo "tests/gpu/check.sh: skipped, no NVIDIA GPU here (nvidia-smi lists none)"
    exit 0
fi
make setup GPU=1

out="runs/gpu-check-$(date +%Y%m%d-%H%M%S)"
data=$(.venv/bin/python -c "from common import synthetic; print(synthetic.ensure(n_images=1200, image_size=256))")
status=0
timeout --kill-after 20 480 .venv/bin/python -m common.run --data-dir "$data" --out "$out" \
    -p EPOCHS 1 -p IMAGE_SIZE 224 -p MAX_IMAGES 1200 -p BENCH_STEPS 20 -p PRECISION mixed || status=$?
if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
    echo "tests/gpu/check.sh: the runs took longer than 480 s (the 8-minute budget); see $out/executed/" >&2
fi

.venv/bin/python - "$out" <<'PY'
import sys

import pandas as pd

from common import report, results

rows = []
for record in results.load_all(f"{sys.argv[1]}/results"):
    memory = {device: value["memory_peak_mib"] for device, value in record["device_utilization"].items()}
    rows.append({"notebook": report.label(record), "devices": record["devices"], "data": record["data"],
                 "precision": record["precision"], "images/s": round(record["images_per_second"], 1),
                 "peak MiB per GPU": " ".join(f"{device}:{mib:.0f}" for device, mib in sorted(memory.items()))})
if rows:
    print(pd.DataFrame(rows).sort_values(["notebook", "devices", "data"]).to_string(index=False))
print(f"records and executed notebooks: {sys.argv[1]}")
PY
exit "$status"
