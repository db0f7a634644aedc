#!/usr/bin/env bash
# PopuLoRA on NNODES nodes x GPUS_PER_NODE GPUs, submitted to an existing Ray cluster.
#
#   head:     ray start --head --num-gpus 8
#   workers:  ray start --address <head-ip>:6379 --num-gpus 8
#   NNODES=4 PRESET=8t8s RAY_ADDRESS=http://<head-ip>:8265 RUN_DIR=/shared/ckpt/8t8s bash launch/ray_job_multinode.sh
#
# RUN_DIR must be on storage every node sees. Environment: see launch/lib.sh. DRY_RUN=1 prints the command.
# The run's preflight goes first, as a Ray job of its own that probes every node, and prints one table; a refusal
# stops here (exit 2). PREFLIGHT=0 skips it.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
NNODES=${NNODES:-2}

populora_args "$NNODES"
populora_submit "$@"
