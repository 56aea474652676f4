"""Real vLLM (CPU) through the engine contract suite, in its default multiprocess mode.

Besides the suite: skyrl's bootstrap ran inside vLLM's own processes (proven by a probe plugin),
weight updates reach the worker through a file, and ``close`` leaves no vLLM process behind.
"""

from __future__ import annotations

import os

import pytest

from skyrl_core.testing.engine_contract import MODEL_SEED, EngineContract, request
from skyrl_vllm import bootstrap
from skyrl_vllm.engine import VLLMEngine
from skyrl_vllm.options import VLLMOptions
from vllm_test_helpers import (
    environ,
    live_descendants,
    probe_env,
    probe_reports,
    requires_vllm_cpu,
    vllm_processes,
    write_probe_plugin,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, requires_vllm_cpu]

OPTIONS = VLLMOptions(kv_cache_memory_bytes=32 << 20, max_model_len=256, max_num_seqs=32)


class TestVLLMEngine(EngineContract):
    unties_unembedding = False  # its library loads no lm_head of a tied model: one given alone is refused
    @pytest.fixture(scope="class")
    @classmethod
    def probe(cls, tmp_path_factory):
        root = tmp_path_factory.mktemp("vllm-probe")
        reports = root / "reports"
        reports.mkdir()
        return probe_env(write_probe_plugin(str(root / "plugin")), str(reports)), str(reports)

    @pytest.fixture(scope="class")
    @classmethod
    def engine_factory(cls, probe):
        env, _ = probe

        def make(model, seed):
            with environ(env):  # vLLM's processes are spawned now and inherit the probe plugin
                return VLLMEngine(model, OPTIONS, seed=seed)

        return make

    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls, engine_factory, model_config, prompts):
        """The suite's shared engine. Its ``close`` is checked here, when the class ends, rather than
        on a second engine (each start spawns an engine core and a worker: ~20 s): closed twice, it
        leaves none of the processes or files it made, and refuses to generate."""
        before = live_descendants()
        engine = engine_factory(model_config, MODEL_SEED)
        started = live_descendants() - before
        (worker,) = engine.execution_contract()["workers"]
        assert worker["pid"] in started and len(started) >= 2  # engine core + worker
        workdir = engine._workdir  # the model written for vLLM, weight files
        yield engine
        engine.close()
        engine.close()
        assert live_descendants() & started == set()
        assert not os.path.exists(workdir)
        with pytest.raises(RuntimeError, match="closed"):
            engine.generate([request(prompts[3], "c", max_tokens=2)])

    def test_bootstrap_ran_once_in_every_vllm_process(self, engine, probe):
        _, reports_dir = probe
        (worker,) = engine.execution_contract()["workers"]
        assert worker["bootstrap_ran"] is True and worker["pid"] != os.getpid()
        reports = probe_reports(reports_dir)
        started = vllm_processes()  # this class's engine: its engine core and its worker
        assert worker["pid"] in started and len(started) == 2
        # The probe plugin answered skyrl_worker_init(role="engine", engine="vllm") exactly once in each of them.
        assert {pid: reports.get(pid) for pid in started} == {pid: ["engine:vllm"] for pid in started}
        assert bootstrap.ran_in_this_process()  # the front-end (this process) is initialised too

    def test_execution_contract_comes_from_the_worker(self, engine):
        contract = engine.execution_contract()
        assert contract["engine"] == "vllm" and contract["dtype"] == "float32" and contract["device"] == "cpu"
        (worker,) = contract["workers"]
        assert worker["dtype"] == "float32" and worker["vllm"] == contract["vllm"]
        assert contract["ledger"] == worker["ledger"]
        assert contract["ledger"]["linear@engine_decode"]["impl"] == "torch.linear"

    def test_each_weight_update_replaces_the_last_weights_file(self, engine, reference_model):
        """An update sends the worker a file that stays until the next update replaces it, whether
        or not a pause came between (resume once forgot the file, so every in-flight update of a
        fully_async run left a model-sized file behind until close)."""
        weights = [(name, p.detach()) for name, p in reference_model.named_parameters()]  # its own weights
        engine.pause()
        engine.update_weights(weights)
        engine.resume()
        engine.update_weights(weights)
        engine.update_weights(weights)
        assert len([f for f in os.listdir(engine._workdir) if f.endswith(".safetensors")]) == 1

    def test_close_is_idempotent(self, engine, prompts):
        """Before the close the ``engine`` fixture checks at the class's end: the engine generates,
        and the processes and directory that close must remove are there."""
        assert engine.generate([request(prompts[3], "c", max_tokens=2, seed=0)])[0][0].token_ids
        (worker,) = engine.execution_contract()["workers"]
        assert worker["pid"] in vllm_processes() and os.path.isdir(engine._workdir)
