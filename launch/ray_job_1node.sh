#!/usr/bin/env bash
# PopuLoRA on one node x 8 GPUs: training (DeepSpeed) and vLLM colocated on every GPU.
#
#   ray start --head --num-gpus 8                 # once, on the node (the plugin installed in this Python)
#   PRESET=4t4s MODEL=Qwen/Qwen2.5-Coder-7B-Instruct RUN_DIR=/ckpt/4t4s bash launch/ray_job_1node.sh [flags...]
#
# Extra flags go last and win over the preset (e.g. --populora.total_steps 100 --ckpt.load_enable).
# The run's preflight goes first, as a Ray job of its own: one table (model, CUDA, flash-attn, GPU memory, adapter
# directory, tensor parallelism, run-directory lock, Ray resources); a refusal stops here. PREFLIGHT=0 skips it.
# Environment: see launch/lib.sh. DRY_RUN=1 prints the command.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

populora_args 1
populora_submit "$@"
