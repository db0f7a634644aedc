# Two commands do all the set-up (see README.md):
#   make run    a real PopuLoRA self-play run on the embedded default (CPU preset)
#   make test   the full test suite
# Each creates .venv and installs everything first when needed (scripts/install.sh is idempotent).
PY := .venv/bin/python
RUN_DIR ?= runs/laptop
export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install install-gpu check-gpu-deps run test lint bench
install:
	bash scripts/install.sh

# a GPU cluster node: torch for CUDA 13.0, flash-attn and DeepSpeed built against it, vLLM, OpenRLHF (into
# $PYTHON or python3's environment, not .venv; needs CUDA_HOME with nvcc 13; scripts/install-gpu.sh)
install-gpu:
	bash scripts/install-gpu.sh

# resolve the GPU install's requirements against PyPI without installing (CI runs it; no GPU needed)
check-gpu-deps:
	$${PYTHON:-python3} scripts/gpu_resolve.py

run: install
	$(PY) -m openrlhf_populora.cli.train --config configs/laptop.yaml --ckpt.output_dir $(RUN_DIR)

test: install
	bash scripts/test.sh

lint: install
	.venv/bin/ruff check .

bench: install
	$(PY) benchmarks/sandbox.py
	$(PY) benchmarks/evolution.py
