"""``FullyAsyncRollouts`` with a real torch engine and rollout generator (tiny model): groups
older than ``max_staleness`` are dropped or regenerated and counted; what a step gets is within
the bound, per token."""

from __future__ import annotations

import time

import pytest

from skyrl_core.config.schema import ModelConfig, Selection
from skyrl_core.models import load_causal_lm, load_tokenizer
from skyrl_core.plugins.manager import new_plugin_manager
from skyrl_core.rollout import ChatCodec, EnvironmentFactory, RolloutGenerator, Sampling
from skyrl_core.trainer.async_rl import FullyAsyncRollouts
from skyrl_core.trainer.runtime import build_selected
from skyrl_core.trainer.sampler import PromptSampler
from tests.rollout.chatml import save_chatml_tokenizer
from tests.rollout.envs import TINY_QWEN3, TestEnvironments, prompt_rows


@pytest.mark.parametrize("on_stale", ["drop", "regenerate"])
def test_stale_groups_are_dropped_or_regenerated_and_counted(tmp_path, on_stale):
    pm = new_plugin_manager()
    pm.register_plugin(TestEnvironments(), "test-envs")
    model = ModelConfig(config=TINY_QWEN3, tokenizer=save_chatml_tokenizer(tmp_path))
    engine = build_selected(pm, "inference_engine", Selection(name="torch"), model, seed=0)
    weights = list(load_causal_lm(model, seed=0).state_dict().items())
    generator = RolloutGenerator(engine, ChatCodec(load_tokenizer(model)), EnvironmentFactory(pm, "digits"))
    started: list[str] = []  # the prompt of every group a worker generates
    generate = generator.generate
    generator.generate = lambda rows, *a, **k: started.append(rows[0]["prompt"][0]["content"]) or generate(rows, *a, **k)
    source = FullyAsyncRollouts(engine, generator, PromptSampler(prompt_rows(40, "digits"), seed=0),
                                Sampling(n=2, max_new_tokens=6), seed=0, stepwise=False, prompts_per_step=2,
                                max_inflight=4, max_staleness=0, on_stale=on_stale)
    try:
        _, samples, metrics = source.collect(1)  # trains version 0: everything so far is version 0
        assert {v for s in samples for v in s.versions} == {0} and metrics["async/dropped"] == 0
        # Admission: under version 0 no group starts beyond the step's two; under version 1 two more.
        assert source._groups == 2
        source.sync_weights(1, lambda: iter(weights))
        deadline = time.monotonic() + 60
        while len(source._buffer) < 2 and time.monotonic() < deadline:  # the two groups of version 1
            time.sleep(0.01)
        assert len(source._buffer) == 2 and source._groups == 4
        source.sync_weights(2, lambda: iter(weights))
        _, samples, metrics = source.collect(3)  # trains version 2: the buffered groups are stale
        assert metrics["async/dropped"] >= 2 and metrics["async/staleness_max"] == 0
        assert {v for s in samples for v in s.versions} == {2} and len(samples) == 4
        deadline = time.monotonic() + 30
        while source._redo and time.monotonic() < deadline:  # the workers take the stale rows up again
            time.sleep(0.01)
        again = len(started) - len(set(started))  # prompts generated a second time
        assert (again >= metrics["async/dropped"]) if on_stale == "regenerate" else again == 0
    finally:
        source.close()
        engine.close()
