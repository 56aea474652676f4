#!/usr/bin/env bash
# IsoExec inside CUDA vLLM on one GPU machine, in under 10 minutes (called by scripts/gpu_check.sh):
# plugins/skyrl-isoexec/tests/vllm/test_vllm_isoexec_gpu.py, i.e. CUDA vLLM with IsoExec against
# the CUDA FSDP trainer, bitwise, for Qwen3, Llama, Qwen3-MoE and Qwen3-Next in float32 and bfloat16, plus stock CUDA vLLM
# as the negative control; and the seed's own pairing, the skyrl-megatron trainer in bf16 against CUDA
# vLLM for Qwen3, Llama and Qwen3-MoE where Transformer Engine is installed in this venv (IsoExec on:
# megatron's local layers in bf16, 0 differing; off: Transformer Engine's layers, differing). Without
# transformer_engine (install a build matching vllm's CUDA torch into $VENV) those tests skip.
#
# What differs from the CPU checks: the canonical attention is registered in vLLM's CUSTOM backend
# slot and selected with attention_config={"backend": "CUSTOM"} (on CPU it replaces CPU_ATTN); the
# engine runs eager (CUDA graphs and torch.compile would capture/fuse around the canonical ops) and
# on vLLM's V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0; the V2 runner has its own sampler).
#
# CUDA vllm pins its own torch, so it gets its own venv (.venv-gpu-vllm, shared with
# gpu_engines_check.sh; reused when present). Packages come from the configured index, or offline
# from WHEELHOUSE=/dir.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false VLLM_USE_V2_MODEL_RUNNER=0
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv-gpu-vllm}
PIP_SOURCE=()
if [ -n "${WHEELHOUSE:-}" ]; then PIP_SOURCE=(--no-index --find-links "$WHEELHOUSE"); fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q "${PIP_SOURCE[@]}" vllm psutil pytest pytest-timeout
"$VENV/bin/pip" install -q "${PIP_SOURCE[@]}" -e ".[train,dev]" -e plugins/skyrl-vllm -e plugins/skyrl-fsdp \
  -e plugins/skyrl-isoexec -e plugins/skyrl-megatron "megatron-core==0.16.1"
"$VENV/bin/python" -c 'import torch, vllm; print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, vllm {vllm.__version__}, {torch.cuda.device_count()} GPU(s)")'
timeout 540 "$VENV/bin/python" -m pytest plugins/skyrl-isoexec/tests/vllm/test_vllm_isoexec_gpu.py -m gpu -q -rs \
  -p no:cacheprovider
