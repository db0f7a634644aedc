#!/usr/bin/env bash
# Installs the plugin and its GPU stack (torch for CUDA 13.0, flash-attn, DeepSpeed with FusedAdam prebuilt,
# vLLM 0.29.0, OpenRLHF 0.11.2) into the Python environment of $PYTHON (default: python3 on PATH; give it a
# virtual or conda environment of its own). For a Linux x86_64 node with an NVIDIA driver for CUDA 13 (R580 or
# newer) and the CUDA 13.0 toolkit (nvcc), which the two source builds need. Run it on every node of the cluster
# (Ray runs `python3` there), or install once on storage every node imports from. `make install-gpu` runs it.
#
# Order matters: flash-attn's setup.py imports torch, so it is built without build isolation after torch (a
# plain `pip install .[gpu]` fails under isolation); DeepSpeed is built the same way with DS_BUILD_FUSED_ADAM=1,
# so no rank JIT-compiles FusedAdam at start (which needs nvcc on every node). The project's [gpu] extra then
# brings vLLM, OpenRLHF and the rest, with torch, flash-attn and DeepSpeed held where they are.
#
# Environment: PYTHON, MAX_JOBS (parallel compile jobs, default 4: each flash-attn job can take several GB of
# RAM), FLASH_ATTN_WHEEL (a flash-attn 2.8.3 wheel built for torch 2.13 + CUDA 13 to install instead of
# building; path or URL), DS_BUILD_CPU_ADAM=1 (also prebuild DeepSpeed's CPU Adam, for --ds.adam_offload).
# `scripts/gpu_resolve.py` (CI) resolves the same requirements without installing, so a version conflict
# shows there first. The pins below must equal pyproject.toml's (tests/project/test_packaging.py checks).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH="torch==2.13.0"           # what vllm 0.29.0 pins; PyPI's Linux x86_64 wheel of it is built for CUDA 13.0
FLASH_ATTN="flash-attn==2.8.3"  # what openrlhf 0.11.2 pins; PyPI has only its source
DEEPSPEED="deepspeed==0.19.6"   # what openrlhf 0.11.2 pins; PyPI has only its source
CUDA_MAJOR=13                   # torch's CUDA: extensions must be compiled by an nvcc of the same major version
PIP=("$PY" -m pip install --disable-pip-version-check)

say() { echo "[install-gpu] $*"; }
die() { echo "[install-gpu] error: $*" >&2; exit 1; }

# 0. what the builds need, checked before anything is downloaded
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || die "$PY is older than Python 3.10 (set PYTHON)"
[[ $(uname -s) == Linux && $(uname -m) == x86_64 ]] || die "torch $TORCH's CUDA build and vLLM's wheel are for Linux x86_64"
if [[ -z ${CUDA_HOME:-} ]]; then
    if command -v nvcc >/dev/null 2>&1; then
        CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")")
    elif [[ -x /usr/local/cuda/bin/nvcc ]]; then
        CUDA_HOME=/usr/local/cuda
    fi
fi
if [[ -z ${CUDA_HOME:-} || ! -x ${CUDA_HOME}/bin/nvcc ]]; then
    die "no CUDA toolkit found (CUDA_HOME${CUDA_HOME:+=$CUDA_HOME} has no bin/nvcc, and nvcc is not on PATH).
  flash-attn and DeepSpeed's FusedAdam are compiled here with nvcc, against torch's CUDA $CUDA_MAJOR.0.
  Load a CUDA $CUDA_MAJOR.0 toolkit (e.g. 'module load cuda/$CUDA_MAJOR.0') or install NVIDIA's, then
  export CUDA_HOME=<its root, holding bin/nvcc> and run this again."
fi
export CUDA_HOME PATH="$CUDA_HOME/bin:$PATH"
nvcc_version=$("$CUDA_HOME/bin/nvcc" --version | sed -n 's/.*release \([0-9][0-9.]*\).*/\1/p')
[[ ${nvcc_version%%.*} == "$CUDA_MAJOR" ]] || die "nvcc at $CUDA_HOME is CUDA ${nvcc_version:-?}; torch 2.13.0 from PyPI
  is built for CUDA $CUDA_MAJOR.0 and torch refuses to compile extensions with another major version. Point
  CUDA_HOME at a CUDA $CUDA_MAJOR toolkit."
if command -v nvidia-smi >/dev/null 2>&1; then
    driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1 || true)
    [[ -z $driver || ${driver%%.*} -ge 580 ]] || say "warning: NVIDIA driver $driver is older than R580, which CUDA $CUDA_MAJOR needs: torch will not see the GPUs"
else
    say "no nvidia-smi here (a login node?): the driver is not checked"
fi
say "installing into $("$PY" -c 'import sys; print(sys.prefix)') with CUDA $nvcc_version at $CUDA_HOME"

# 1. torch, CUDA build, and what the --no-build-isolation builds import
"${PIP[@]}" "$TORCH"
"$PY" - "$CUDA_MAJOR" <<'EOF' || die "the installed torch is not a CUDA $CUDA_MAJOR build (a local wheel or constraint in your pip configuration?)"
import sys, torch
sys.exit(not (torch.version.cuda or "").startswith(sys.argv[1] + "."))
EOF
"${PIP[@]}" setuptools wheel packaging psutil ninja einops

# 2. flash-attn: a given wheel, else built from source against this torch (its setup looks for a prebuilt wheel
#    of its own on GitHub first; there is none for torch 2.13, so it compiles: long, hence MAX_JOBS)
fa_pin=${FLASH_ATTN#*==}
if [[ $("$PY" -c 'import importlib.metadata as m; print(m.version("flash-attn"))' 2>/dev/null || true) == "$fa_pin" ]]; then
    say "flash-attn $fa_pin already installed: not rebuilt"
elif [[ -n ${FLASH_ATTN_WHEEL:-} ]]; then
    "${PIP[@]}" --no-deps "$FLASH_ATTN_WHEEL"
else
    say "building $FLASH_ATTN with MAX_JOBS=${MAX_JOBS:-4} (can take an hour or more)"
    MAX_JOBS=${MAX_JOBS:-4} "${PIP[@]}" --no-build-isolation --no-cache-dir "$FLASH_ATTN"
fi

# 3. DeepSpeed with FusedAdam compiled now (reinstalled: an install without it would count as satisfied)
DS_BUILD_FUSED_ADAM=1 "${PIP[@]}" --no-build-isolation --no-cache-dir --force-reinstall --no-deps "$DEEPSPEED"
"$PY" -c 'from deepspeed.git_version_info import installed_ops; import sys; sys.exit(not installed_ops.get("fused_adam"))' \
    || die "DeepSpeed installed without its prebuilt FusedAdam (see the build log above)"

# 4. the plugin with its [gpu] extra (vLLM, OpenRLHF, Ray, ...), torch, flash-attn and DeepSpeed held in place
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
printf '%s\n' "$TORCH" "$FLASH_ATTN" "$DEEPSPEED" > "$constraints"
"${PIP[@]}" -e ".[gpu]" -c "$constraints"
"$PY" -m pip check
"$PY" - <<'EOF'
import importlib.metadata as m
import torch
print("[install-gpu] done:", ", ".join(f"{name} {m.version(name)}" for name in (
    "torch", "flash-attn", "deepspeed", "vllm", "openrlhf", "ray", "transformers", "openrlhf-populora")),
    f"(torch CUDA {torch.version.cuda}; GPUs visible here: {torch.cuda.device_count()})")
EOF
