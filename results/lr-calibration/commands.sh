#!/usr/bin/env bash
# Learning-rate calibration on the 2T+2S signature preset (configs/signature.yaml): up to 10 steps at each of four
# learning rates spanning 100x, side by side (one torch thread each on the 2-core machine), same seed and data.
# The committed runs stopped after 2-7 steps (README.md says when and why). This starts all four at once, as they
# ran; four runs of ~6.5 GB do not fit in 24 GB (one was killed by the OOM killer and resumed): on such a machine
# start three and the fourth when one stops. Then the curves and the choice:
#   .venv/bin/python benchmarks/lr_sweep.py results/lr-calibration/lr*/ --out results/lr-calibration --window 2 --steps 5
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p runs/lr-calibration
pids=()
for lr in 2e-5 1e-4 5e-4 2e-3; do
  OMP_NUM_THREADS=1 .venv/bin/python -m openrlhf_populora.cli.train --config configs/signature.yaml \
    --actor.adam.lr "$lr" --populora.total_steps 10 --ckpt.output_dir "runs/lr-calibration/lr$lr" \
    --ckpt.load_enable --no-populora.report > "runs/lr-calibration/lr$lr.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done  # a plain `wait` returns 0 whatever the runs did
exit $status
