#!/usr/bin/env bash
# The paper's timescale on the laptop: four arms x three seeds, 120 steps each, on Qwen2.5-Coder-0.5B-Instruct
# (CPU), at the settings of the 40-step experiment (results/cpu-signature-v2):
#   population  configs/signature.yaml                          2 teachers + 2 students, failure-rate reward
#   baseline    configs/signature-baseline.yaml                 its compute-matched single agent, learnability
#   control     configs/signature-baseline-failure-rate.yaml    the same single agent on the failure-rate reward
#   1t1s        configs/signature-1t1s.yaml                     1 teacher + 1 student, failure-rate reward
#
# One code commit for every step of every run: the runs execute a clone of this repository checked out at
# CODE_COMMIT (under runs/, never committed), so what lands on main while they run (refactors, other issues)
# cannot change a step. run_meta.json records each start's and resume's commit all the same.
#
#   bash results/cpu-horizon/commands.sh          start or resume the runs, two at a time (PARALLEL), one thread each
#   bash results/cpu-horizon/commands.sh sync     copy every run's small files, finished or not, into results/
#       (not a run restarted from step 0 that has fewer steps than its files there: those are kept)
#   bash results/cpu-horizon/commands.sh table    the pass@1 table of each finished seed (SEEDS="1" for one), at the
#       last step, into table-s<seed>/: the base model, B1, the population (means, best student and teacher,
#       worst member, every member), the control's agent and 1T+1S's student (cli.evaluate --arm); greedy
#       pass@1 on all 164 HumanEval problems and the fixed 200 of MBPP, as results/cpu-signature-v2/table; then,
#       from two seeds on, the table across seeds (cli.seeds_table) into table/
#   bash results/cpu-horizon/commands.sh same     steps 1-40 of each run against the 40-step experiment's
#       (results/cpu-signature-v2): which steps differ, and in which keys (timings left out); SAME_DIR=runs/cpu-horizon
#       compares the runs in progress instead of their committed files, SAME_AGAINST=results/cpu-horizon compares
#       with these committed files (a run restarted on another machine against the run it replaces), SAME_STEPS=N
#       compares steps 1-N (default 40)
#   bash results/cpu-horizon/commands.sh stop     stop starting runs, and stop the running ones after their step
#   bash results/cpu-horizon/commands.sh analyse  the verdicts, from the committed files of finished runs: cli.compare
#       on the windows 1:40, 41:80 and 81: for population vs baseline, population vs control and 1t1s vs baseline
#       (compare-<pair>-<window>/), and cli.collapse over every run (collapse/); it refuses while a run it needs has
#       fewer than STEPS steps here (SEEDS="1" narrows it to some seeds, for a look that is not a verdict)
#
# Every run checkpoints every step under runs/cpu-horizon/<arm>-s<seed> and resumes where it stopped
# (--ckpt.load_enable), so running this again continues the experiment; a run whose files here hold STEPS steps
# and that has no directory under runs/ is done and is skipped. runs/ is never committed: a machine without it
# restarts an unfinished run from step 0 (at the same commit), which then replaces that run's files here.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
CODE_COMMIT=${CODE_COMMIT:-71adf1718796c22b6233e6ddb57ee8353bbae8d0}
STEPS=${STEPS:-120}
OUT=runs/cpu-horizon
R=results/cpu-horizon
CODE=$OUT/code
ARMS=(signature signature-baseline signature-baseline-failure-rate signature-1t1s)
mkdir -p "$OUT"

sync_files() {  # $1 = arm-s<seed>: its small files (never adapters or checkpoints), whatever step it is at
  local run=$OUT/$1
  [[ -f $run/metrics.jsonl ]] || return 0
  local have=0 now
  now=$(wc -l < "$run/metrics.jsonl")
  [[ -f $R/$1/metrics.jsonl ]] && have=$(wc -l < "$R/$1/metrics.jsonl")
  if ((now < have)); then  # a run restarted from step 0 on a machine without its checkpoint: keep the longer files
    echo "$1: kept the $have steps in $R/$1 (the run here, restarted, is at step $now)"
    return 0
  fi
  mkdir -p "$R/$1"
  for f in config.yaml run_meta.json metrics.jsonl events.jsonl population.json problems.jsonl buffers.jsonl; do
    [[ -f $run/$f ]] && cp "$run/$f" "$R/$1/"
  done
  echo "$1: $(wc -l < "$run/metrics.jsonl") steps copied to $R/$1"
}

if [[ "${1:-}" == stop ]]; then  # the queue first (a stopped run exits 130 and xargs would start the next one)
  pkill -f "xargs -P ${PARALLEL:-2} -L 1 bash -c" || true
  pkill -TERM -f "openrlhf_populora.cli.train .*--ckpt.output_dir $(pwd)/$OUT/" || true
  echo "asked the queue and the runs to stop; each run checkpoints its step in progress, then exits (status 130)"
  exit 0
fi

if [[ "${1:-}" == analyse ]]; then
  read -ra seeds <<< "${SEEDS:-1 2 3}"
  runs() { for seed in "${seeds[@]}"; do echo "$R/$1-s$seed"; done; }
  missing=()
  for arm in "${ARMS[@]}"; do for run in $(runs "$arm"); do
    [[ -f $run/metrics.jsonl && $(wc -l < "$run/metrics.jsonl") -ge $STEPS ]] || missing+=("$run")
  done; done
  ((${#missing[@]} == 0)) || { echo "unfinished (fewer than $STEPS steps): ${missing[*]}" >&2; exit 2; }
  tag=""; [[ "${SEEDS:-1 2 3}" == "1 2 3" ]] || tag="-seeds${SEEDS// /}"
  for pair in "signature signature-baseline baseline" "signature signature-baseline-failure-rate control" \
              "signature-1t1s signature-baseline 1t1s-baseline"; do
    read -r pop base name <<< "$pair"
    for window in 1:40 41:80 81:; do
      out=$R/compare-$name-${window%:*}-${window#*:}$tag
      mkdir -p "$out"
      "$ROOT/.venv/bin/python" -m openrlhf_populora.cli.compare --population $(runs "$pop") \
        --baseline $(runs "$base") --steps "$window" --out "$out" > "$out/compare.txt"
      echo "wrote $out"
    done
  done
  all=(); for arm in "${ARMS[@]}"; do all+=($(runs "$arm")); done
  mkdir -p "$R/collapse$tag"
  "$ROOT/.venv/bin/python" -m openrlhf_populora.cli.collapse "${all[@]}" --out "$R/collapse$tag" \
    > "$R/collapse$tag/collapse.txt"
  echo "wrote $R/collapse$tag"
  exit 0
fi

if [[ "${1:-}" == same ]]; then  # steps 1-40 (SAME_STEPS) against the 40-step experiment's run of the same arm and seed
  "$ROOT/.venv/bin/python" - "${SAME_DIR:-$R}" "${SAME_AGAINST:-results/cpu-signature-v2}" "${SAME_STEPS:-40}" <<'PY'
import json, pathlib, sys
new_root, old_root = map(pathlib.Path, sys.argv[1:3])
last = int(sys.argv[3])
for run in sorted(p.parent for p in new_root.glob("*-s*/metrics.jsonl")):
    old_file = old_root / run.name / "metrics.jsonl"
    if not old_file.exists():
        continue
    rows = lambda f: [json.loads(line) for line in f.read_text().splitlines()][:last]
    new, old = rows(run / "metrics.jsonl"), rows(old_file)
    diffs = {}  # step -> keys that differ, timings (time, time/*) left out
    for a, b in zip(new, old):
        keys = {k for k in a.keys() | b.keys() if k != "time" and not k.startswith("time/")}
        if bad := sorted(k for k in keys if a.get(k) != b.get(k)):
            diffs[a["step"]] = bad
    print(f"{run.name}: steps 1-{min(len(new), len(old))} compared, {len(diffs)} differ"
          + "".join(f"\n  step {s}: {len(k)} keys ({', '.join(k[:4])}{', ...' if len(k) > 4 else ''})"
                    for s, k in diffs.items()))
PY
  exit 0
fi

if [[ "${1:-}" == table ]]; then  # the pass@1 table of each seed whose four runs have finished (SEEDS)
  read -ra seeds <<< "${SEEDS:-1 2 3}"
  for seed in "${seeds[@]}"; do
    for arm in "${ARMS[@]}"; do  # the adapters live only under runs/ (never committed): this machine's runs
      [[ -d $OUT/$arm-s$seed/adapters && -f $R/$arm-s$seed/metrics.jsonl \
         && $(wc -l < "$R/$arm-s$seed/metrics.jsonl") -ge $STEPS ]] \
        || { echo "seed $seed: $arm has not finished $STEPS steps here (its adapters: $OUT/$arm-s$seed)" >&2; exit 2; }
    done
    store=$OUT/eval-s$seed
    if [[ ! -f $store/samples.jsonl ]]; then  # the base model's graded samples, already made: only adapters generate
      mkdir -p "$store"
      cp results/cpu-signature-v2/eval-base/{samples.jsonl,settings.json} "$store/"
    fi
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$ROOT/.venv/bin/python" -m openrlhf_populora.cli.evaluate \
      --run "$OUT/signature-s$seed" --baseline "$OUT/signature-baseline-s$seed" --base \
      --arm "control=$OUT/signature-baseline-failure-rate-s$seed" --arm "1t1s=$OUT/signature-1t1s-s$seed" \
      --benchmarks humaneval,mbpp --sample mbpp=200 --dtype bf16 --out "$store"
    mkdir -p "$R/table-s$seed"  # the table and every graded completion behind it (a few MB a seed)
    cp "$store"/{results.md,results.csv,results.json,results.png,settings.json,samples.jsonl} "$R/table-s$seed/"
    echo "wrote $R/table-s$seed"
  done
  done_seeds=(); for seed in 1 2 3; do [[ -f $R/table-s$seed/results.json ]] && done_seeds+=("$R/table-s$seed"); done
  if ((${#done_seeds[@]} >= 2)); then  # the table across the seeds evaluated so far
    "$ROOT/.venv/bin/python" -m openrlhf_populora.cli.seeds_table "${done_seeds[@]}" --out "$R/table" > /dev/null
    echo "wrote $R/table (${#done_seeds[@]} seeds)"
  fi
  exit 0
fi

if [[ "${1:-}" == sync ]]; then
  for seed in 1 2 3; do for arm in "${ARMS[@]}"; do sync_files "$arm-s$seed"; done; done
  exit 0
fi

# the pinned code: a plain clone (its own .git, so provenance reads its commit even if this checkout is re-cloned)
if [[ ! -d $CODE/.git ]]; then
  git clone -q "$ROOT" "$CODE"
fi
git -C "$CODE" checkout -q "$CODE_COMMIT"
[[ -z $(git -C "$CODE" status --porcelain --untracked-files=no) ]] || { echo "$CODE has local changes" >&2; exit 2; }

jobs=()
for seed in 1 2 3; do
  for arm in "${ARMS[@]}"; do
    if [[ ! -d "$OUT/$arm-s$seed" && -f "$R/$arm-s$seed/metrics.jsonl" \
          && $(wc -l < "$R/$arm-s$seed/metrics.jsonl") -ge $STEPS ]]; then
      echo "$arm seed $seed: done (its files are in $R/$arm-s$seed)"
      continue
    fi
    jobs+=("$arm $seed")
  done
done
export ROOT OUT R CODE STEPS
export -f sync_files
# the pinned clone's package first on the path (this checkout's .venv holds the dependencies), configs read there
((${#jobs[@]})) && printf '%s\n' "${jobs[@]}" | xargs -P "${PARALLEL:-2}" -L 1 bash -c '
  arm=$0 seed=$1 run=$ROOT/$OUT/$arm-s$seed
  if (cd "$CODE" && OMP_NUM_THREADS=1 PYTHONPATH="$ROOT/$CODE" "$ROOT/.venv/bin/python" -m openrlhf_populora.cli.train \
      --config "configs/$arm.yaml" --train.seed "$seed" --populora.total_steps "$STEPS" --ckpt.output_dir "$run" \
      --ckpt.load_enable >> "$run.log" 2>&1)
  then
    sync_files "$arm-s$seed"
    echo "$arm seed $seed: finished"
  else
    echo "$arm seed $seed stopped (status $?)"
  fi'
exit 0
