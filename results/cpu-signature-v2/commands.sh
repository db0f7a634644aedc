#!/usr/bin/env bash
# The laptop experiment, v2: three arms x three seeds, 40 steps each, on Qwen2.5-Coder-0.5B-Instruct (CPU).
#   population  configs/signature.yaml                          2 teachers + 2 students, failure-rate reward
#   baseline    configs/signature-baseline.yaml                 its compute-matched single agent, learnability
#   control     configs/signature-baseline-failure-rate.yaml    the same single agent on the failure-rate reward
# The learning rate is the calibrated one (results/lr-calibration), set in configs/signature.yaml, which the two
# baselines inherit (baseline_for: signature).
#
# Nine runs, at most three at a time (each holds about 6.5 GB; four ran out of 24 GB), one torch thread each;
# PARALLEL=2 on 2 cores. Every run checkpoints every step under runs/ and this script resumes each where it
# stopped (--ckpt.load_enable), so running it again continues the experiment. runs/ is never committed and a
# fresh machine does not have it, so the moment a run finishes its 40 steps its small files are copied here
# (results/cpu-signature-v2/<arm>-s<seed>/: its config, metrics, events, population, problems and task buffers,
# which table.sh exports for stock OpenRLHF), and a run whose files here already hold 40 steps and that has no
# directory under runs/ is done and is skipped (delete its files here to run it again).
# Afterwards (the last block): the comparisons across seeds and the figures.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=runs/cpu-signature-v2
R=results/cpu-signature-v2
mkdir -p "$OUT"
jobs=()
for seed in 1 2 3; do
  for arm in signature signature-baseline signature-baseline-failure-rate; do
    if [[ ! -d "$OUT/$arm-s$seed" && -f "$R/$arm-s$seed/metrics.jsonl" \
          && $(wc -l < "$R/$arm-s$seed/metrics.jsonl") -ge 40 ]]; then
      echo "$arm seed $seed: done (its files are in $R/$arm-s$seed)"
      continue
    fi
    jobs+=("$arm $seed")
  done
done
# what is committed: each run's small result files, never its adapters or checkpoints
((${#jobs[@]})) && printf '%s\n' "${jobs[@]}" | xargs -P "${PARALLEL:-3}" -L 1 bash -c '
  arm=$0 seed=$1 run='"$OUT"'/$arm-s$seed
  if OMP_NUM_THREADS=1 .venv/bin/python -m openrlhf_populora.cli.train --config "configs/$arm.yaml" \
      --train.seed "$seed" --populora.total_steps 40 --ckpt.output_dir "$run" --ckpt.load_enable >> "$run.log" 2>&1
  then
    mkdir -p '"$R"'/$arm-s$seed
    cp "$run"/{config.yaml,run_meta.json,metrics.jsonl,events.jsonl,population.json,problems.jsonl,buffers.jsonl} \
      '"$R"'/$arm-s$seed/
    echo "$arm seed $seed: finished, files copied to '"$R"'/$arm-s$seed"
  else
    echo "$arm seed $seed stopped (status $?)"
  fi'

for seed in 1 2 3; do
  for arm in signature signature-baseline signature-baseline-failure-rate; do
    [[ -f "$R/$arm-s$seed/metrics.jsonl" && $(wc -l < "$R/$arm-s$seed/metrics.jsonl") -ge 40 ]] \
      || { echo "$arm seed $seed has not finished: no comparison yet"; exit 0; }
  done
done

# the comparisons across seeds, from the committed files alone (anyone can rerun them from a clone): the
# population against its baseline (population and reward rule together), and against the control (the same
# reward rule: the population alone)
mkdir -p $R/compare-baseline $R/compare-control
.venv/bin/python -m openrlhf_populora.cli.compare --population $R/signature-s{1,2,3} \
  --baseline $R/signature-baseline-s{1,2,3} --out $R/compare-baseline | tee $R/compare-baseline/compare.txt
.venv/bin/python -m openrlhf_populora.cli.compare --population $R/signature-s{1,2,3} \
  --baseline $R/signature-baseline-failure-rate-s{1,2,3} --out $R/compare-control | tee $R/compare-control/compare.txt
# every run's curves side by side (learning diagnostics, rewards, format rates, complexity, coverage)
.venv/bin/python -m openrlhf_populora.cli.report $R/signature{,-baseline,-baseline-failure-rate}-s{1,2,3} \
  --out $R/figures
