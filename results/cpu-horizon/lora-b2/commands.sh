#!/usr/bin/env bash
# Stock OpenRLHF 0.11.2 trained with LoRA (rank 8 on q/v at lr 1e-4, as B1's adapters), by the B2 recipe
# (launch/stock_b2_cpu.sh: unmodified train_ppo_ray through cli.stock_ppo), on the tiny random model built in
# code (the failure does not depend on the model: it is in the names the weight sync sends). Writes under
# runs/lora-b2 and prints the exit status; the log this folder keeps (run.log) is its output, trimmed.
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-runs/lora-b2}
rm -rf "$OUT"; mkdir -p "$OUT"
.venv/bin/python -c "
import sys
from openrlhf_populora.models.tiny import VLLM_HEADS, save_tiny_model
save_tiny_model(sys.argv[1], seed=0, heads=VLLM_HEADS)" "$OUT/model"
STEPS=export OUT=$OUT SEED_FILE=configs/seeds/basic.jsonl TASK_TYPES=code_o LIMIT=4 bash launch/stock_b2_cpu.sh
STEPS=train OUT=$OUT MODEL=$OUT/model MAX_NEW_TOKENS=48 EPISODES=1 LR=1e-4 bash launch/stock_b2_cpu.sh \
  --ds.lora.rank 8 --ds.lora.alpha 16 --ds.lora.target_modules q_proj v_proj
echo "exit status: $?"
