#!/usr/bin/env bash
# GPU checks of skyrl-megatron on one CUDA machine, in under 10 minutes (called by scripts/gpu_check.sh).
# Runs plugins/skyrl-megatron/tests/test_gpu.py: the training-backend contract suite on CUDA
# (Transformer Engine layer spec when transformer_engine imports, else megatron's local spec;
# megatron-core's DDP wrapper and optimizer; nccl) and bf16 training with megatron's fp32 main
# parameters, for Qwen3, Qwen3-MoE (TE layers, all-to-all dispatcher) and the Qwen3-Next hybrid (local
# modules; needs flash-linear-attention, else that class skips with the reason), and IsoExec on with TE
# installed in bf16 (the rank builds megatron's local layers instead: the op sites map those only). The two-GPU test
# skips on a single GPU. Not run yet: no GPU was available while writing it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export HF_HUB_OFFLINE=1 RAY_AUTH_MODE=disabled
"$PY" - <<'PYEOF'
import torch
import megatron.core

print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)")
print(f"megatron-core {megatron.core.__version__}")
try:
    import fla  # noqa: F401

    print("flash-linear-attention installed: the Qwen3-Next hybrid runs")
except ImportError:
    print("flash-linear-attention not installed: the Qwen3-Next GPU tests skip")
try:
    import transformer_engine

    print(f"transformer_engine {transformer_engine.__version__}: TE layer spec")
except ImportError:
    print("transformer_engine not installed: megatron's local layer spec")
PYEOF
timeout 540 "$PY" -m pytest plugins/skyrl-megatron/tests/test_gpu.py -m gpu -q -rs -p no:cacheprovider
