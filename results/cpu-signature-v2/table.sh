#!/usr/bin/env bash
# The headline pass@1 table of the laptop experiment, once commands.sh has finished one seed's population and
# baseline (SEED, default 1) on this machine: their adapters are read from runs/.
# Greedy pass@1 with 95% intervals on all 164 HumanEval problems and on a fixed sample of 200 of MBPP's 500 test
# problems (cli.evaluate --sample: the 200 whose SHA-256 of 'mbpp/<problem id>' is smallest). No package on PyPI
# ships the EvalPlus data (HumanEval+, MBPP+), so these are the plain versions. Rows: the base model, the
# baseline B1, stock OpenRLHF's single agent B2, and the population: its mean per role, best student, best
# teacher and worst member, and every member.
#
# One seed of each arm (evaluating every seed's members costs about 25 machine-minutes a model here: the base model took
# 11 minutes on HumanEval and 13 on the MBPP sample, side by side on the 2 cores, 2026-12-05).
#
# The local engine (transformers + peft, bf16), not vLLM's CPU build (measured 2026-12-05; those logs were not
# kept): on the first 32 HumanEval problems with the base model, both beside two training runs on the 2 cores,
# vLLM took 926 s to generate and local 970 s (the same 28 passes; 31 of 32 completions identical), and at 64
# problems in one batch vLLM had not finished after 1,800 s (local: ~1,940 s by the 32's rate); vLLM also spends
# ~6 minutes warming up each engine here. Its continuous batching saves the local engine's padding (a batch runs
# to its longest completion: 396 tokens against a mean of 160 in those 32) but not on this CPU.
#
# B2 is stock OpenRLHF (launch/stock_b2_cpu.sh: unmodified train_ppo_ray, a full fine-tune) on the tasks the
# baseline's solver drew (its buffers, each task as the type it answered it as, in the compact chat prompts it
# saw), matched to the baseline's solver side: 40 steps of 8 prompts x 2 samples = 16 answers and one update a
# step, as B1's 4 tasks x 2 types x 2 samples; one episode over the distinct tasks repeated evenly to 320 lines
# (cli.tasks export --repeat-to; upstream shuffles them). B1 also trained its proposer (8 proposals a step),
# which stock OpenRLHF has no role for. Same sampling (T 0.7, top-p 0.95, 192 new tokens), no KL, a constant
# learning rate. Its learning rate is 1e-5, a tenth of the adapters' calibrated 1e-4 (results/lr-calibration):
# Thinking Machines' "LoRA Without Regret" finds LoRA's best RL learning rate about 10x full fine-tuning's (a
# heuristic here: B1's adapters are attention-only, rank 8, and B2's rate was not swept). At these settings the
# machine's used memory peaked at 22.1 GB (free -m every 5 s) and the 40 steps took 2 h 05 min (2026-12-05): run it
# alone. Upstream's REINFORCE++ whitens advantages over the whole batch; PopuLoRA's baseline within each
# (role, task type) group, skipping groups whose rewards are all equal.
# B2_LR (default 1e-5) sets B2's learning rate; a space-separated list trains (STEP=b2) or evaluates
# (STEP=evaluate) one B2 per rate. A rate other than 1e-5 gets its own names, so that nothing resumes from or
# overwrites another rate's: runs/.../stock-b2-lr<rate>-s<seed>, results/.../stock-b2-lr<rate>-s<seed>, the
# report <table>/b2-lr<rate>-training and the table row stock-openrlhf-lr<rate>. The first B2 (lr 1e-5) collapsed
# onto the game on the benchmarks (README.md here): B2_LR=1e-6, stock_b2_cpu.sh's default, tells the rate from the method.
# Both steps resume: the evaluation continues from its samples.jsonl, and stock OpenRLHF from its checkpoint.
# STEP=evaluate-b2 evaluates only B2 (each rate of B2_LR) beside the base model, for a machine that no longer has
# the seed's PopuLoRA adapters (runs/ is not kept from one machine to the next): its store starts from the
# seed's committed table (the base model's samples are reused, not generated again, so B2 is paired with the same
# base answers as every row there), and its table goes to <table>/b2<tag>-eval/, with B2's own samples only.
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS=runs/cpu-signature-v2
R=results/cpu-signature-v2
STEP=${STEP:-b2 evaluate}
SEED=${SEED:-1}
TABLE=$R/table  # seed 1's, the one README.md here quotes; another seed's goes to table-s<seed>
[[ "$SEED" == 1 ]] || TABLE=$R/table-s$SEED
read -ra B2_LRS <<< "${B2_LR:-1e-5}"
((${#B2_LRS[@]})) || { echo "table.sh: B2_LR is empty" >&2; exit 2; }
b2_tag() { [[ "$1" == 1e-5 ]] || echo "-lr$1"; }  # 1e-5 keeps the first B2's names
# B2 trains on the baseline's committed task buffers ($R/signature-baseline-s$SEED/buffers.jsonl): any machine.
# The evaluation reads the trained adapters, which live only under runs/ (never committed): the seed's population
# and baseline must be there, finished (commands.sh); on a machine without them, move the seed's files out of
# results/ and run commands.sh.
if [[ " $STEP " == *" evaluate "* ]]; then
  for arm in signature signature-baseline; do
    [[ -d "$RUNS/$arm-s$SEED/adapters" ]] || { echo "table.sh: $RUNS/$arm-s$SEED/adapters is missing: run seed" \
      "$SEED of $arm first (commands.sh; it skips a run whose files are in $R, so move them aside)" >&2; exit 2; }
  done
fi
if [[ " $STEP " == *" evaluate-b2 "* ]]; then
  [[ -f "$TABLE/samples.jsonl" ]] || { echo "table.sh: $TABLE/samples.jsonl is missing: evaluate-b2 pairs B2 with" \
    "the base model's answers in the seed's committed table" >&2; exit 2; }
fi
if [[ " $STEP " == *" evaluate "* || " $STEP " == *" evaluate-b2 "* ]]; then  # refuse before training, not after
  b2_models=()
  for lr in "${B2_LRS[@]}"; do
    tag=$(b2_tag "$lr")
    [[ " $STEP " == *" b2 "* || -f "$RUNS/stock-b2$tag-s$SEED/hf/config.json" ]] || { echo "table.sh:" \
      "$RUNS/stock-b2$tag-s$SEED/hf is missing: train B2 at lr $lr first (STEP=b2 B2_LR=$lr)" >&2; exit 2; }
    b2_models+=(--model "stock-openrlhf$tag=$RUNS/stock-b2$tag-s$SEED/hf")
  done
fi

if [[ " $STEP " == *" b2 "* ]]; then
  [[ -f "$R/signature-baseline-s$SEED/buffers.jsonl" ]] || { echo "table.sh: $R/signature-baseline-s$SEED/" \
    "buffers.jsonl is missing: finish seed $SEED of the baseline first (commands.sh copies it there)" >&2; exit 2; }
  for lr in "${B2_LRS[@]}"; do
    tag=$(b2_tag "$lr")
    b2=(env OUT="$RUNS/stock-b2$tag-s$SEED" FROM_RUN="$R/signature-baseline-s$SEED" MODEL=embedded-coder
        MAX_NEW_TOKENS=192 LR="$lr" SEED="$SEED" REPEAT_TO=320 ROLLOUT_BATCH=8 N_SAMPLES=2 TRAIN_BATCH=16 EPISODES=1)
    "${b2[@]}" STEPS=export bash launch/stock_b2_cpu.sh
    mkdir -p "$TABLE" && cp "$RUNS/stock-b2$tag-s$SEED/code_tasks.jsonl" "$TABLE/b2-tasks.jsonl"  # small: committed
    # sampling as the PopuLoRA runs sample (configs/signature.yaml), not upstream's defaults (T=1, top-p 1)
    "${b2[@]}" STEPS=train bash launch/stock_b2_cpu.sh --ckpt.save_steps 5 --ckpt.load_enable \
      --rollout.temperature 0.7 --rollout.top_p 0.95
    # its training curves beside B1's (committed: the TensorBoard event file, ~100 KB, and the report); a B2 that
    # was stopped and resumed has one event file per launch: keep those in one directory per launch to report them
    mkdir -p "$R/stock-b2$tag-s$SEED"
    cp "$RUNS/stock-b2$tag-s$SEED"/tensorboard/*/events.out.tfevents.* "$R/stock-b2$tag-s$SEED/"
    .venv/bin/python -m openrlhf_populora.cli.report "$R/signature-baseline-s$SEED" "$R/stock-b2$tag-s$SEED" \
      --quiet --labels "B1 (PopuLoRA baseline)" "B2 (stock OpenRLHF, lr $lr)" --out "$TABLE/b2$tag-training"
  done
fi

if [[ " $STEP " == *" evaluate "* ]]; then
  # A new store starts from committed samples (SEED_STORE): "table", this seed's table where it has one (every
  # graded completion; only new models are generated; the default), "base", the base model's alone
  # (eval-base/commands.sh), or "none". The store refuses samples whose settings differ (exit 2): the base model's
  # converted path (~/.cache/openrlhf_populora/...), or, from a table, an adapter's hash (a seed's runs do not
  # repeat bit for bit on another machine). Then delete $RUNS/eval-s$SEED and pass SEED_STORE=base, or none.
  SEED_STORE=${SEED_STORE:-table}
  [[ -n "${SKIP_BASE_SAMPLES:-}" ]] && SEED_STORE=none  # its older name
  [[ "$SEED_STORE" =~ ^(table|base|none)$ ]] || { echo "table.sh: SEED_STORE is table, base or none," \
    "not '$SEED_STORE'" >&2; exit 2; }
  if [[ ! -f "$RUNS/eval-s$SEED/samples.jsonl" && "$SEED_STORE" != none ]]; then
    from="$R/eval-base"
    [[ "$SEED_STORE" == table && -f "$TABLE/samples.jsonl" ]] && from="$TABLE"
    mkdir -p "$RUNS/eval-s$SEED"
    cp "$from"/{samples.jsonl,settings.json} "$RUNS/eval-s$SEED/"
  fi
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} .venv/bin/python -m openrlhf_populora.cli.evaluate \
    --run "$RUNS/signature-s$SEED" --baseline "$RUNS/signature-baseline-s$SEED" --base \
    "${b2_models[@]}" \
    --benchmarks humaneval,mbpp --sample mbpp=200 --dtype bf16 --out "$RUNS/eval-s$SEED"
  mkdir -p "$TABLE"
  # the table and every graded completion behind it (samples.jsonl: about 2 MB a seed)
  cp "$RUNS"/eval-s$SEED/{results.md,results.csv,results.json,results.png,settings.json,samples.jsonl} "$TABLE/"
fi

if [[ " $STEP " == *" evaluate-b2 "* ]]; then
  for lr in "${B2_LRS[@]}"; do
    tag=$(b2_tag "$lr")
    store=$RUNS/eval-b2$tag-s$SEED
    if [[ ! -f $store/samples.jsonl ]]; then
      mkdir -p "$store"
      cp "$TABLE"/{samples.jsonl,settings.json} "$store/"
    fi
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} .venv/bin/python -m openrlhf_populora.cli.evaluate --base \
      --base-model embedded-coder --model "stock-openrlhf$tag=$RUNS/stock-b2$tag-s$SEED/hf" \
      --benchmarks humaneval,mbpp --sample mbpp=200 --dtype bf16 --out "$store"
    mkdir -p "$TABLE/b2$tag-eval"
    cp "$store"/{results.md,results.csv,results.json,results.png,settings.json} "$TABLE/b2$tag-eval/"
    # B2's graded completions (the base model's are in $TABLE/samples.jsonl already)
    .venv/bin/python -c 'import json, sys
for line in open(sys.argv[1]):
    if json.loads(line)["member"] == sys.argv[2]:
        sys.stdout.write(line)' "$store/samples.jsonl" "stock-openrlhf$tag" > "$TABLE/b2$tag-eval/samples.jsonl"
    echo "wrote $TABLE/b2$tag-eval"
  done
fi
