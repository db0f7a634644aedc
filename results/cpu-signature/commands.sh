#!/usr/bin/env bash
# The exact commands behind results/cpu-signature/ (run from the repository root, after `make install`).
# The two runs went side by side, one core each, on a 2-core machine (configs/signature*.yaml set
# populora.num_threads: 1); each can stop and resume exactly with --ckpt.load_enable.
# These runs predate the learning-rate calibration (configs/signature.yaml now sets 1e-4; they ran at 2e-5, as
# their config.yaml records, hence the flag below) and the answer parser's fix (results/format-rate): today's code
# plays a different game from theirs, so this reruns the protocol, not these numbers.
set -euo pipefail
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
RUNS=${RUNS:-runs}
mkdir -p "$RUNS"

.venv/bin/python -m openrlhf_populora.cli.train --config configs/signature.yaml --actor.adam.lr 2e-5 \
    --ckpt.output_dir "$RUNS/signature" > "$RUNS/signature.log" 2>&1 &
population=$!
.venv/bin/python -m openrlhf_populora.cli.train --config configs/signature-baseline.yaml --actor.adam.lr 2e-5 \
    --ckpt.output_dir "$RUNS/signature-baseline" > "$RUNS/signature-baseline.log" 2>&1 &
baseline=$!
status=0  # each run's status (a plain `wait` returns 0 whatever they did; `a && b` under set -e ignores a's)
wait "$population" || status=$?
wait "$baseline" || status=$?
((status == 0)) || exit "$status"
# after an interruption, the same two commands with --ckpt.load_enable added resume where the checkpoints left off

# what is committed: each run's small result files, never its adapters or checkpoints
for run in signature signature-baseline; do
    mkdir -p "results/cpu-signature/$run"
    cp "$RUNS/$run"/{config.yaml,run_meta.json,metrics.jsonl,events.jsonl,population.json,problems.jsonl} "results/cpu-signature/$run/"
done

# the comparison, from the committed files alone (so anyone can rerun it from a clone)
.venv/bin/python -m openrlhf_populora.cli.compare results/cpu-signature/signature \
    results/cpu-signature/signature-baseline --out results/cpu-signature | tee results/cpu-signature/compare.txt
