#!/usr/bin/env bash
# Stock OpenRLHF (baseline B2) on one machine without GPUs, in three commands: export the code tasks as
# OpenRLHF's prompt dataset, train with unmodified openrlhf.cli.train_ppo_ray (through cli.stock_ppo, which adds
# only what a CPU needs; on a GPU node call train_ppo_ray itself, see README.md), evaluate its HF checkpoint
# beside a PopuLoRA run and its baseline (B1). Run from the repository root, after `make install`.
#
#   bash launch/stock_b2_cpu.sh                                   # export + train on the embedded code model
#   POP=runs/signature B1=runs/signature-baseline bash launch/stock_b2_cpu.sh   # ... + the pass@1 table
#   STEPS=evaluate POP=... B1=... bash launch/stock_b2_cpu.sh     # only the table, for a finished stock run
#
# Environment (defaults in brackets); extra arguments go to train_ppo_ray and win over these:
#   MODEL [embedded-coder]  a local HF model directory or one of this package's model names
#     (a full fine-tune beside vLLM: the 0.5B code model peaked at 20.6 GB of RAM with the defaults below,
#     MODEL=embedded about 7.5 GB; launch/README.md has the measurements)
#   OUT [runs/stock-b2]     code_tasks.jsonl, hf/ (the trained model), checkpoints/, tensorboard/
#   SEED_FILE [configs/seeds/basic.jsonl] or FROM_RUN (a run directory: the tasks its solvers drew, as the types
#     they answered them as, in the prompts they saw)
#   TASK_TYPES [code_o,code_i]  LIMIT [all]  REPEAT_TO [off: each task once]  EPISODES [1]  LR [1e-6]
#   MAX_NEW_TOKENS [192]  SEED [42]
#   ROLLOUT_BATCH [4] prompts a step, N_SAMPLES [2] per prompt, TRAIN_BATCH [8], TRAIN_MICRO [1]
#   The learning rate is constant (PopuLoRA's is; upstream's default decays to a tenth by cosine after warm-up).
#   ZERO_STAGE [0]: one rank needs no ZeRO, whose flat fp32 copy and reduce buckets cost ~3 GB on the 0.5B model
#   POP, B1 (run directories), BENCHMARKS [humaneval], DATA_DIR, EVAL_LIMIT: the evaluation
#   STEPS ["export train evaluate"]
set -euo pipefail
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
# glibc returns freed blocks over 128 KiB to the system: without it the engine keeps a model's worth of heap
# after each weight sync (measured on SmolLM2: 2.4 -> 2.9 GB)
export MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-131072}
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/stock-b2}
STEPS=${STEPS:-export train evaluate}
has() { [[ " $STEPS " == *" $1 "* ]]; }
mkdir -p "$OUT"

if has export; then
    source_args=(--seed-file "${SEED_FILE:-configs/seeds/basic.jsonl}")
    [[ -n "${FROM_RUN:-}" ]] && source_args=(--run "$FROM_RUN")
    "$PY" -m openrlhf_populora.cli.tasks export "${source_args[@]}" --task-types "${TASK_TYPES:-code_o,code_i}" \
        ${LIMIT:+--limit "$LIMIT"} ${REPEAT_TO:+--repeat-to "$REPEAT_TO"} --out "$OUT/code_tasks.jsonl"
fi

if has train; then
    # the path is the last line: a first use converts the model, and DeepSpeed's accelerator notice goes to stdout
    model_dir=$("$PY" -c 'import sys; from openrlhf_populora.models.embedded import resolve_model; print(resolve_model(sys.argv[1], for_vllm=True))' "${MODEL:-embedded-coder}" | tail -n 1)
    [[ -f "$model_dir/config.json" ]] || { echo "stock_b2_cpu.sh: MODEL ${MODEL:-embedded-coder} resolved to" \
        "'$model_dir', which is not a model directory" >&2; exit 2; }
    "$PY" -m openrlhf_populora.cli.stock_ppo \
        --actor.model_name_or_path "$model_dir" --actor.num_nodes 1 --actor.num_gpus_per_node 1 \
        --vllm.num_engines 1 --vllm.enforce_eager --ds.zero_stage "${ZERO_STAGE:-0}" --actor.adam.lr "${LR:-1e-6}" \
        --actor.lr_scheduler constant --actor.lr_warmup_ratio 0 \
        --algo.advantage.estimator reinforce --algo.kl.init_coef 0 \
        --reward.remote_url "$("$PY" -m openrlhf_populora.cli.tasks reward-file)" \
        --data.prompt_dataset "$OUT/code_tasks.jsonl" --data.input_key prompt --data.label_key label \
        --data.apply_chat_template --data.max_len 2048 --rollout.max_new_tokens "${MAX_NEW_TOKENS:-192}" \
        --rollout.batch_size "${ROLLOUT_BATCH:-4}" --rollout.n_samples_per_prompt "${N_SAMPLES:-2}" \
        --rollout.micro_batch_size "${ROLLOUT_BATCH:-4}" --train.batch_size "${TRAIN_BATCH:-8}" \
        --train.micro_batch_size "${TRAIN_MICRO:-1}" --actor.gradient_checkpointing_enable \
        --train.max_epochs 1 --train.num_episodes "${EPISODES:-1}" --train.seed "${SEED:-42}" \
        --ckpt.output_dir "$OUT/hf" --ckpt.save_hf --ckpt.path "$OUT/checkpoints" \
        --logger.tensorboard_dir "$OUT/tensorboard" "$@"
fi

if has evaluate; then
    if [[ -z "${POP:-}" ]]; then
        echo "evaluate: set POP (a PopuLoRA run) and B1 (its baseline run) for the pass@1 table" >&2
        exit 0
    fi
    "$PY" -m openrlhf_populora.cli.evaluate --run "$POP" ${B1:+--baseline "$B1"} --model "stock-openrlhf=$OUT/hf" \
        --benchmarks "${BENCHMARKS:-humaneval}" ${DATA_DIR:+--data-dir "$DATA_DIR"} ${EVAL_LIMIT:+--limit "$EVAL_LIMIT"} \
        --out "$OUT/eval"
fi
