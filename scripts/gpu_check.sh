#!/usr/bin/env bash
# All GPU checks on one CUDA machine (make gpu-check): every test marked `gpu`, then each plugin's own
# GPU script if present. On a CPU-only machine the gpu tests skip with their reason.
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
make venv || exit 1
.venv/bin/python -m pytest -m gpu -q -rs || status=1
for script in scripts/gpu_engines_check.sh scripts/gpu_megatron_check.sh scripts/gpu_isoexec_vllm_check.sh; do
  if [ -f "$script" ]; then
    echo "== $script"
    bash "$script" || status=1
  fi
done
exit $status
