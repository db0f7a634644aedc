#!/usr/bin/env bash
# The exact command behind results/compare-calibration/ (from the repository root, after `make install`): 150
# comparisons per (process, steps, seeds) cell, 2 worker processes on the shared 2-core machine (47 minutes,
# with other jobs running). calibration.md is its stdout, calibration.json the counts.
set -euo pipefail
export OMP_NUM_THREADS=1
.venv/bin/python benchmarks/compare_calibration.py --draws 150 --workers 2 \
    --json results/compare-calibration/calibration.json > results/compare-calibration/calibration.md
