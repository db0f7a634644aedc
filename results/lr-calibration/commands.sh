#!/usr/bin/env bash
# Learning-rate calibration on the 2T+2S signature preset (configs/signature.yaml): 10 steps at each of four
# learning rates spanning 100x, side by side (one torch thread each on the 2-core machine), same seed and data.
# Then the curves and the choice: python results/lr-calibration/summarize.py
set -euo pipefail
cd "$(dirname "$0")/../.."
for lr in 2e-5 1e-4 5e-4 2e-3; do
  OMP_NUM_THREADS=1 .venv/bin/python -m openrlhf_populora.cli.train --config configs/signature.yaml \
    --actor.adam.lr "$lr" --populora.total_steps 10 --ckpt.output_dir "runs/lr-calibration/lr$lr" \
    --ckpt.load_enable --no-populora.report > "runs/lr-calibration/lr$lr.log" 2>&1 &
done
wait
