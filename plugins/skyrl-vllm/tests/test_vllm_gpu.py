"""Real vLLM on a CUDA GPU through the engine contract suite (skipped without CUDA).

Run with ``scripts/gpu_engines_check.sh`` on a GPU machine. fp32 eager, compared with the CPU fp32
reference model: a GPU's reductions differ in order, hence a looser logprob tolerance than on CPU.
On CUDA vLLM has sleep mode, so the suite's sleep/wake test exercises a real release and restore.
"""

from __future__ import annotations

import pytest

from skyrl_core.testing.engine_contract import EngineContract

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.vllm]


class TestVLLMEngineOnGPU(EngineContract):
    unties_unembedding = False  # its library loads no lm_head of a tied model: one given alone is refused
    logprob_atol = 2e-4

    @pytest.fixture(scope="class")
    @classmethod
    def engine_factory(cls):
        from skyrl_vllm.engine import VLLMEngine
        from skyrl_vllm.options import VLLMOptions

        options = VLLMOptions(kv_cache_memory_bytes=256 << 20, max_model_len=256, enforce_eager=True)
        return lambda model, seed: VLLMEngine(model, options, seed=seed)

    def test_sleep_is_real_on_cuda(self, engine):
        assert engine.sleep_supported is True
        contract = engine.execution_contract()
        assert contract["device"] == "cuda" and contract["workers"][0]["device"].startswith("cuda")
