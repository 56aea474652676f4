"""``trainer.mode``: every accepted value runs what it names (tests/e2e/test_execution_modes.py);
combinations a mode cannot do are refused before any rollout, naming the keys."""

from __future__ import annotations

import pytest

from skyrl_core.config.loader import ConfigError, structure_config
from skyrl_core.plugins.manager import get_plugin_manager
from skyrl_core.trainer.async_rl import check_mode

TINY = {"model": {"config": {"model_type": "llama"}}}


def _load(mode: str, **extra):
    return structure_config({**TINY, "trainer": {"mode": mode}, **extra})


@pytest.mark.parametrize("mode", ["sync", "one_step_off", "fully_async"])
def test_each_mode_is_accepted(mode):
    assert _load(mode).trainer.mode == mode


def test_unknown_mode_and_bad_async_options_are_refused():
    with pytest.raises(ConfigError, match="trainer.mode"):
        _load("async")
    with pytest.raises(ConfigError, match="trainer.fully_async.on_stale"):
        structure_config({**TINY, "trainer": {"mode": "fully_async", "fully_async": {"on_stale": "keep"}}})
    with pytest.raises(ConfigError, match="trainer.fully_async.max_inflight"):
        structure_config({**TINY, "trainer": {"fully_async": {"max_inflight": 0}}})


@pytest.mark.parametrize("mode", ["one_step_off", "fully_async"])
def test_async_modes_need_an_engine_that_pauses(mode):
    pm = get_plugin_manager()
    check_mode(_load(mode), pm)  # the torch engine pauses and serves concurrent calls
    check_mode(_load(mode, engine={"name": "vllm"}), pm)  # so does vLLM's (multiprocess mode, the default)
    for engine in ({"name": "openai", "options": {"launch": True}}, {"name": "sglang"}):
        if engine["name"] not in pm.registry.names("inference_engine"):
            continue
        with pytest.raises(ValueError, match=f"trainer.mode='{mode}' needs an engine that pauses"):
            check_mode(_load(mode, engine=engine), pm)


@pytest.mark.parametrize("mode", ["one_step_off", "fully_async"])
def test_dynamic_sampling_is_refused_outside_sync(mode):
    cfg = _load(mode, algorithm={"dynamic_sampling": {"mode": "drop"}})
    with pytest.raises(ValueError, match="dynamic_sampling"):
        check_mode(cfg, get_plugin_manager())


@pytest.mark.parametrize("mode", ["one_step_off", "fully_async"])
def test_an_in_process_vllm_engine_is_refused_in_the_async_modes(mode):
    """vLLM in the calling process (offline LLM) can neither pause nor serve concurrent calls."""
    from skyrl_vllm.preflight import problems

    cfg = _load(mode, engine={"name": "vllm", "options": {"multiprocess": False}})
    (problem,) = problems(cfg, cfg.engine.options)
    assert f"engine.options.multiprocess: false cannot serve trainer.mode: '{mode}'" in problem
    assert problems(_load("sync", engine={"name": "vllm", "options": {"multiprocess": False}}), cfg.engine.options) == []
    default = _load(mode, engine={"name": "vllm"})
    assert problems(default, default.engine.options) == []


class PausesButKeepsKV:
    """An engine class that pauses and serves concurrent calls but cannot recompute the keys/values
    of paused samples (``supports_kv_recompute`` absent)."""

    supports_pause = True


def test_kv_on_update_is_checked_and_recompute_needs_an_engine_that_does_it(fresh_plugin_manager):
    from skyrl_core.plugins import hookimpl
    from skyrl_core.plugins.records import InferenceEngineSpec

    assert _load("fully_async").trainer.fully_async.kv_on_update == "recompute"  # the default
    with pytest.raises(ConfigError, match=r"trainer\.fully_async\.kv_on_update.*'drop'"):
        structure_config({**TINY, "trainer": {"mode": "fully_async", "fully_async": {"kv_on_update": "drop"}}})

    class Plugin:
        @hookimpl
        def skyrl_register_inference_engines(self, register):
            register(InferenceEngineSpec(name="keeps_kv", factory=f"{__name__}:PausesButKeepsKV"))

    pm = fresh_plugin_manager
    pm.register_plugin(Plugin(), "keeps-kv")
    for engine in ({"name": "torch"}, {"name": "vllm"}):
        check_mode(_load("fully_async", engine=engine), pm)
    with pytest.raises(ValueError, match=r"trainer\.fully_async\.kv_on_update='recompute' needs an engine .* "
                                         r"engine 'keeps_kv' cannot .*fully_async\.kv_on_update=keep"):
        check_mode(_load("fully_async", engine={"name": "keeps_kv"}), pm)
    keep = {"mode": "fully_async", "fully_async": {"kv_on_update": "keep"}}
    check_mode(_load("fully_async", engine={"name": "keeps_kv"}, trainer=keep), pm)
    check_mode(_load("one_step_off", engine={"name": "keeps_kv"}), pm)  # (nothing is in flight at its updates)
