#!/usr/bin/env bash
# GPU checks of the vLLM and SGLang engines on one CUDA machine, in under 10 minutes (called by
# scripts/gpu_check.sh). Runs the engine contract suite on CUDA vLLM
# (plugins/skyrl-vllm/tests/test_vllm_gpu.py) and on SGLang (plugins/skyrl-sglang/tests/test_sglang_gpu.py).
#
# vllm and sglang pin different torch builds, so each gets its own venv (.venv-gpu-vllm,
# .venv-gpu-sglang; reused when present). Packages come from the configured index, or offline from
# WHEELHOUSE=/dir (pip --no-index --find-links) on a machine without network access.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PYTHON=${PYTHON:-python3}
PIP_SOURCE=()
if [ -n "${WHEELHOUSE:-}" ]; then PIP_SOURCE=(--no-index --find-links "$WHEELHOUSE"); fi

setup_venv() {  # setup_venv DIR PACKAGE... : a venv with skyrl (editable) and PACKAGEs
  local venv=$1
  shift
  [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
  "$venv/bin/pip" install -q "${PIP_SOURCE[@]}" "$@" psutil pytest pytest-timeout
  "$venv/bin/pip" install -q "${PIP_SOURCE[@]}" -e ".[train,dev]" -e plugins/skyrl-vllm
}

status=0
run() {  # run VENV TESTFILE
  echo "== $2 ($1)"
  "$1/bin/python" -c 'import torch; print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)")'
  timeout 270 "$1/bin/python" -m pytest "$2" -m gpu -q -rs -p no:cacheprovider || status=1
}

setup_venv .venv-gpu-vllm vllm
run .venv-gpu-vllm plugins/skyrl-vllm/tests/test_vllm_gpu.py

setup_venv .venv-gpu-sglang sglang torch_memory_saver
.venv-gpu-sglang/bin/pip install -q "${PIP_SOURCE[@]}" --no-deps -e plugins/skyrl-sglang
run .venv-gpu-sglang plugins/skyrl-sglang/tests/test_sglang_gpu.py
exit $status
