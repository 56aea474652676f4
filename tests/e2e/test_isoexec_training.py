"""With IsoExec on, the trainer's and the engine's logprobs agree bit for bit: the logged mismatch is
exactly 0 and the old-logprob pass is skipped after step 1 (which measures it)."""

from __future__ import annotations

import os

import pytest

from skyrl_core.config.loader import load_config
from skyrl_core.trainer.metrics import read_metrics
from skyrl_core.trainer.rl import train
from tests.e2e.tiny_run import write_tiny_config
from tests.rollout.envs import TestEnvironments


@pytest.mark.slow
def test_isoexec_run_has_zero_mismatch_and_skips_the_old_logprob_pass(tmp_path, fresh_plugin_manager, monkeypatch):
    from skyrl_fsdp.backend import FSDPBackend
    from skyrl_isoexec import state

    fresh_plugin_manager.register_plugin(TestEnvironments(), "test-envs")
    scored: list[int] = []
    original = FSDPBackend.forward

    def counting(self, batch, temperature=1.0):
        scored.append(len(batch))
        return original(self, batch, temperature)

    monkeypatch.setattr(FSDPBackend, "forward", counting)
    monkeypatch.delenv("SKYRL_ISOEXEC", raising=False)
    config = str(write_tiny_config(tmp_path, steps=3, mini_batches=2))
    runs = {}
    saved = state.configure(None)
    try:
        for name, enabled in (("isoexec", "true"), ("stock", "false")):
            scored.clear()
            cfg = load_config(config, [f"isoexec.enabled={enabled}", "data.eval=null",
                                       f"trainer.output_dir={tmp_path / name}"], plugin_manager=fresh_plugin_manager)
            runs[name] = (read_metrics(train(cfg, plugin_manager=fresh_plugin_manager).run_dir), sum(scored))
    finally:
        state.configure(saved)
        os.environ.pop("SKYRL_ISOEXEC", None)

    iso, iso_scored = runs["isoexec"]
    assert iso[0]["mismatch/abs_logprob_diff_max"] == 0.0 and iso[0]["mismatch/kl"] == 0.0
    assert all("mismatch/abs_logprob_diff_max" not in r for r in iso[1:])  # not measured: not computed
    assert iso_scored == 64  # the old-logprob pass ran on step 1 only
    stock, stock_scored = runs["stock"]
    # negative control: without IsoExec the same run has a real mismatch and scores every step
    assert all(r["mismatch/abs_logprob_diff_max"] > 0 for r in stock)
    assert stock_scored == 3 * 64
