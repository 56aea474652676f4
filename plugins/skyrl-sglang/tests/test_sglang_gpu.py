"""Real SGLang on a CUDA GPU through the engine contract suite (skipped without CUDA).

Run with ``scripts/gpu_engines_check.sh`` on a GPU machine. fp32 with the Triton attention backend
(SGLang's deterministic mode supports it), compared with the CPU fp32 reference model: a GPU's
reductions differ in order, hence a looser logprob tolerance than on CPU.
"""

from __future__ import annotations

import pytest

from skyrl_core.testing.engine_contract import EngineContract

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


class TestSGLangEngineOnGPU(EngineContract):
    unties_unembedding = False  # its library loads no lm_head of a tied model: one given alone is refused
    logprob_atol = 2e-4

    @pytest.fixture(scope="class")
    @classmethod
    def engine_factory(cls):
        from skyrl_sglang.engine import SGLangEngine
        from skyrl_sglang.options import SGLangOptions

        options = SGLangOptions(
            dtype="float32", mem_fraction_static=0.3, context_length=256, engine_kwargs={"attention_backend": "triton"}
        )
        return lambda model, seed: SGLangEngine(model, options, seed=seed)

    def test_execution_contract_names_sglang(self, engine):
        contract = engine.execution_contract()
        assert contract["engine"] == "sglang" and contract["device"] == "cuda" and contract["dtype"] == "float32"
