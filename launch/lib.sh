# Shared by the launch scripts (sourced, not run): builds the PopuLoRA command line for a preset, submits it
# to a running Ray cluster with `ray job submit` and follows the job to its end (exit 0 only if it succeeded),
# or prints it one token per line when DRY_RUN=1.
#
# Environment (all optional):
#   PRESET         1t1s | 4t4s | 8t8s | baseline               (default 4t4s: configs/<PRESET>.yaml, read
#                  by the job's driver, so the repository must be where the job runs: this node or shared storage)
#   CONFIG_DIR     where the YAML presets live                  (default: the repository's configs/)
#   MODEL          HF id or local path                          (default Qwen/Qwen2.5-Coder-7B-Instruct)
#   RUN_DIR        run directory: metrics, adapters, checkpoints (default ./runs/populora-<PRESET>); a relative
#                  path is made absolute here, against the directory you submit from (Ray's workers on each node
#                  run in their own directories)
#   GPUS_PER_NODE  GPUs per node                                (default 8)
#   VLLM_TP        vLLM tensor parallel size                    (default 1; engines = GPUs / VLLM_TP, colocated;
#                  must divide GPUS_PER_NODE: an engine never spans nodes)
#   RAY_ADDRESS    Ray dashboard address                        (default http://127.0.0.1:8265)
#   RUNTIME_ENV    --runtime-env-json for the job               (default: tokenizer threads off; env vars and keys
#                  set here win over the launcher's own, which leaves them out of its ray.init: Ray refuses a
#                  key set on both sides)
#   SUBMISSION_ID  the Ray job's id                             (default populora-<PRESET>-<date-time>-<pid>)
#   PREFLIGHT      1 (default): before the run, its preflight (python -m openrlhf_populora.cli.preflight with the
#                  same flags) runs as a Ray job of its own on the same cluster and prints one table; anything it
#                  refuses stops the launch (exit 2) before the run is submitted. 0 skips it
#   DRY_RUN=1      print the run's command instead of submitting anything (tests/project/test_launch_scripts.py uses this)

POPULORA_LAUNCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PRESET=${PRESET:-4t4s}
CONFIG_DIR=${CONFIG_DIR:-$(cd "$POPULORA_LAUNCH_DIR/../configs" && pwd)}
MODEL=${MODEL:-Qwen/Qwen2.5-Coder-7B-Instruct}
RUN_DIR=${RUN_DIR:-./runs/populora-$PRESET}
[[ $RUN_DIR == /* ]] || RUN_DIR=$PWD/${RUN_DIR#./}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
VLLM_TP=${VLLM_TP:-1}
RAY_ADDRESS=${RAY_ADDRESS:-http://127.0.0.1:8265}
RUNTIME_ENV=${RUNTIME_ENV:-'{"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}'}

# Append the flags of an .args file (one flag and its values per line; blank lines and # comments skipped).
populora_read_args() {
  local line words
  [[ -f $1 ]] || { echo "launch: no such preset file: $1" >&2; exit 2; }
  while IFS= read -r line || [[ -n $line ]]; do
    line=${line%%#*}
    read -ra words <<<"$line"
    ((${#words[@]})) && ARGS+=("${words[@]}")
  done <"$1"
}

# ARGS := common flags + the YAML preset + the topology of NNODES x GPUS_PER_NODE (colocated vLLM).
populora_args() {
  local nnodes=$1 gpus=$(($1 * GPUS_PER_NODE))
  # each engine's tensor-parallel workers read the adapter files from their own node's disk, where the engine
  # wrote them: an engine must not span nodes (the launcher checks the same, tensor_parallel_fits)
  if ((VLLM_TP < 1 || GPUS_PER_NODE % VLLM_TP)); then
    echo "launch: VLLM_TP=$VLLM_TP does not divide GPUS_PER_NODE=$GPUS_PER_NODE: a vLLM engine would span nodes," \
      "and its workers on the other node cannot read the adapter files; choose a VLLM_TP that divides a node's GPUs" >&2
    exit 2
  fi
  ARGS=()
  [[ -f $CONFIG_DIR/$PRESET.yaml ]] || { echo "launch: no such preset file: $CONFIG_DIR/$PRESET.yaml" >&2; exit 2; }
  populora_read_args "$POPULORA_LAUNCH_DIR/presets/common.args"
  ARGS+=(--config "$CONFIG_DIR/$PRESET.yaml")
  ARGS+=(--actor.model_name_or_path "$MODEL"
         --actor.num_nodes "$nnodes" --actor.num_gpus_per_node "$GPUS_PER_NODE"
         --vllm.num_engines "$((gpus / VLLM_TP))" --vllm.tensor_parallel_size "$VLLM_TP"
         --ckpt.output_dir "$RUN_DIR" --ckpt.path "$RUN_DIR/checkpoints"
         --logger.tensorboard_dir "$RUN_DIR/tensorboard")
}

# The preflight of ARGS plus "$@" as a Ray job of its own, id $1-preflight: it runs where the run's driver will (the
# head node, the same runtime env), probes every node with a tiny task (model, CUDA, flash-attn, GPU memory,
# adapter directory) and checks the run directory and the cluster's resources against the plan; its table comes
# back in its log. Anything refused stops the launch here, with exit status 2, before the run is submitted.
populora_preflight() {
  local id=$1-preflight
  shift
  ray job submit --address="$RAY_ADDRESS" --runtime-env-json="$RUNTIME_ENV" --submission-id="$id" --no-wait \
    -- python3 -m openrlhf_populora.cli.preflight --populora.engine ray "${ARGS[@]}" "$@"
  if ! python3 "$POPULORA_LAUNCH_DIR/ray_job_follow.py" "$RAY_ADDRESS" "$id"; then
    echo "launch: the preflight ($id) refused this launch, or could not run: its log above says what to fix." \
      "Nothing was submitted (PREFLIGHT=0 skips the preflight)" >&2
    exit 2
  fi
}

# Submit ARGS plus "$@" (extra flags from the command line win: argparse keeps the last value), after its preflight,
# then follow the job to its end with ray_job_follow.py: exit 0 only if it succeeded. Not `ray job submit`'s own
# tail, which can return 0 while the job still runs (ray-project/ray#51601), and the sbatch script would then stop
# Ray under it.
populora_submit() {
  local id=${SUBMISSION_ID:-populora-$PRESET-$(date +%Y%m%d-%H%M%S)-$$}
  local cmd=(ray job submit --address="$RAY_ADDRESS" --runtime-env-json="$RUNTIME_ENV" --submission-id="$id"
             --no-wait -- python3 -m openrlhf_populora.cli.train --populora.engine ray "${ARGS[@]}" "$@")
  if [[ ${DRY_RUN:-0} == 1 ]]; then
    printf '%s\n' "${cmd[@]}"
  else
    if ! python3 -c 'import ray.job_submission' 2>/dev/null; then  # checked before submitting: nothing runs unfollowed
      echo "launch: this python3 cannot import ray.job_submission, which follows the job (ray_job_follow.py):" \
        "run from the Python environment that has Ray" >&2
      exit 2
    fi
    [[ ${PREFLIGHT:-1} == 0 ]] || populora_preflight "$id" "$@"
    "${cmd[@]}"
    python3 "$POPULORA_LAUNCH_DIR/ray_job_follow.py" "$RAY_ADDRESS" "$id"
  fi
}
