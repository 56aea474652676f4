"""The openai engine against a real ``vllm serve`` on loopback, through the engine contract suite.

The launched server gets weights through ``/collective_rpc``; a second engine pointed at the same
server by URL is generation-only.
"""

from __future__ import annotations

import psutil
import pytest

from skyrl_core.testing.engine_contract import MODEL_SEED, EngineContract, request
from skyrl_vllm.openai_engine import OpenAIEngine
from skyrl_vllm.options import OpenAIOptions, VLLMOptions
from vllm_test_helpers import requires_vllm_cpu

pytestmark = [pytest.mark.vllm, pytest.mark.slow, requires_vllm_cpu]

LAUNCH = OpenAIOptions(launch=True, vllm=VLLMOptions(kv_cache_memory_bytes=32 << 20, max_model_len=256, max_num_seqs=32))


def server_processes(engine: OpenAIEngine) -> list[psutil.Process]:
    root = psutil.Process(engine._server.process.pid)
    return [root, *root.children(recursive=True)]


class TestOpenAIEngineOnVLLMServe(EngineContract):
    unties_unembedding = False  # its library loads no lm_head of a tied model: one given alone is refused
    @pytest.fixture(scope="class")
    @classmethod
    def engine_factory(cls):
        return lambda model, seed: OpenAIEngine(model, LAUNCH, seed=seed)

    def test_a_server_given_by_url_generates_the_same_but_takes_no_weights(self, engine, model_config, prompts, reference_model):
        remote = OpenAIEngine(model_config, OpenAIOptions(base_url=engine.root_url + "/v1"))
        try:
            assert remote.model_name == engine.model_name  # read from /v1/models
            req = request(prompts[0], "u", n=2, seed=21, max_tokens=8)
            assert [s.token_ids for s in remote.generate([req])[0]] == [s.token_ids for s in engine.generate([req])[0]]
            with pytest.raises(NotImplementedError, match="only a server it launched itself"):
                remote.update_weights(reference_model.named_parameters())
            assert remote.execution_contract()["ledger"] == {}
        finally:
            remote.close()

    def test_execution_contract_comes_from_the_server_worker(self, engine):
        contract = engine.execution_contract()
        (worker,) = contract["workers"]
        assert worker["bootstrap_ran"] is True
        assert worker["pid"] in {p.pid for p in server_processes(engine)}
        assert contract["ledger"]["attention@engine_prefill"]["impl"] == "torch.attention"

    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls, engine_factory, model_config):
        """The suite's shared engine; closing it must stop the server and every process it started
        (checked here rather than by starting a second server: each start takes minutes on CI)."""
        engine = engine_factory(model_config, MODEL_SEED)
        processes = server_processes(engine)
        assert len(processes) >= 3  # API server, engine core, worker
        yield engine
        engine.close()
        gone, alive = psutil.wait_procs(processes, timeout=30)
        assert alive == [], f"vllm serve processes left running: {alive}"

    def test_close_is_idempotent(self, engine, model_config, prompts):
        """On an engine attached to the shared server by URL (the launched one is closed, and its
        processes checked, when the class ends)."""
        remote = OpenAIEngine(model_config, OpenAIOptions(base_url=engine.root_url + "/v1"))
        assert remote.generate([request(prompts[3], "c", max_tokens=2, seed=0)])[0][0].token_ids
        remote.close()
        remote.close()
        with pytest.raises(RuntimeError, match="closed"):
            remote.generate([request(prompts[3], "c", max_tokens=2)])
        assert engine.generate([request(prompts[3], "c", max_tokens=2, seed=0)])[0][0].token_ids  # server untouched
