#!/usr/bin/env bash
# The base model's row of the headline pass@1 table (results/cpu-signature-v2/table.sh evaluates the trained
# models into the same store and reuses these samples): greedy, bf16, local engine, the chat template (auto),
# 1024 new tokens, all 164 HumanEval problems and the fixed 200 of MBPP's 500 (smallest SHA-256 of
# 'mbpp/<problem id>'). HumanEval and MBPP ran as two processes side by side, one thread each (11 and 13
# minutes on the 2 cores), into two stores that were then concatenated (same settings.json). The committed
# samples were graded with programs run whole and then again with --regrade once the sanitizer existed (6 of
# 364 verdicts changed, all to passes); rerun now, this grades with the sanitizer from the start.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=runs/cpu-signature-v2
for b in humaneval mbpp; do
  extra=(); [[ $b == mbpp ]] && extra=(--sample mbpp=200)
  OMP_NUM_THREADS=1 .venv/bin/python -m openrlhf_populora.cli.evaluate --base-model embedded-coder --base \
    --benchmarks "$b" "${extra[@]}" --dtype bf16 --out "$OUT/eval-base-$b" &
done
wait
mkdir -p "$OUT/eval-base"
cat "$OUT"/eval-base-{humaneval,mbpp}/samples.jsonl > "$OUT/eval-base/samples.jsonl"
cp "$OUT/eval-base-humaneval/settings.json" "$OUT/eval-base/"
.venv/bin/python -m openrlhf_populora.cli.evaluate --base-model embedded-coder --base --benchmarks humaneval,mbpp \
  --sample mbpp=200 --dtype bf16 --out "$OUT/eval-base" --report-only
cp "$OUT"/eval-base/{samples.jsonl,settings.json,results.md,results.csv,results.json,results.png} \
  results/cpu-signature-v2/eval-base/
