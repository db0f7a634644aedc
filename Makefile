# Two commands do all the set-up (see README.md):
#   make run    a real PopuLoRA self-play run on the embedded default (CPU preset)
#   make test   the full test suite
# Each creates .venv and installs everything first when needed (scripts/install.sh is idempotent).
PY := .venv/bin/python
RUN_DIR ?= runs/laptop
export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install run test lint bench
install:
	bash scripts/install.sh

run: install
	$(PY) -m openrlhf_populora.cli.train --config configs/laptop.yaml --ckpt.output_dir $(RUN_DIR)

test: install
	bash scripts/test.sh

lint: install
	.venv/bin/ruff check .

bench: install
	$(PY) benchmarks/sandbox.py
	$(PY) benchmarks/evolution.py
