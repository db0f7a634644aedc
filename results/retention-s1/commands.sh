#!/usr/bin/env bash
# The exact command behind results/retention-s1/ (run from the repository root, after `make install`), on the
# population run of results/cpu-signature/ (configs/signature.yaml, whose checkpoints it needs: every 10 steps).
# It ran alone on one core of the 2-core machine (the run's populora.num_threads: 1), 70-95 s per child step.
set -euo pipefail
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
RUNS=${RUNS:-runs}
.venv/bin/python -m openrlhf_populora.cli.retention --run "$RUNS/signature" --snapshots 10 30 --parents s1 \
    --operators copy_parent M1 M5 --steps 8 --probe-samples 4 --out "$RUNS/retention-s1"

# what is committed: the study's table, figures and each child's metrics, never adapters, checkpoints or snapshots
mkdir -p results/retention-s1
cp "$RUNS/retention-s1"/{retention.md,retention.json,retention_grid.png,retention_measures.png,study.json,parents.json} \
    results/retention-s1/
for child in "$RUNS/retention-s1"/children/*/*; do
    rel=${child#"$RUNS/retention-s1/"}
    mkdir -p "results/retention-s1/$rel"
    cp "$child"/{metrics.jsonl,child.json,config.yaml} "results/retention-s1/$rel/"
done
