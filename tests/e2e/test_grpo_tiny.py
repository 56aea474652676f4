"""End to end: GRPO on a tiny model raises the reward of a task it can learn."""

from __future__ import annotations

import json

import pytest

from skyrl_core.config.loader import load_config
from skyrl_core.trainer.metrics import read_metrics
from skyrl_core.trainer.rl import train
from tests.e2e.tiny_run import write_tiny_config
from tests.rollout.envs import TestEnvironments


@pytest.mark.slow
def test_tiny_grpo_run_raises_reward_and_writes_its_outputs(tmp_path, fresh_plugin_manager) -> None:
    fresh_plugin_manager.register_plugin(TestEnvironments(), "test-envs")
    # one optimizer step per rollout: the old logprobs come from the training forward itself
    config = write_tiny_config(tmp_path, steps=10, eval_every=5, mini_batches=1)
    result = train(load_config(str(config), plugin_manager=fresh_plugin_manager), plugin_manager=fresh_plugin_manager)

    records = read_metrics(result.run_dir)
    assert [r["step"] for r in records] == list(range(11))  # step 0: the evaluation before training
    steps = records[1:]
    early = sum(r["reward/mean"] for r in steps[:3]) / 3
    late = sum(r["reward/mean"] for r in steps[-3:]) / 3
    assert late > early + 0.15, (early, late)
    assert result.eval_after["eval/accuracy"] > result.eval_before["eval/accuracy"]
    for r in steps:
        for key in ("loss", "grad_norm", "lr", "entropy", "response_length/mean", "time/rollout", "time/train",
                    "mismatch/abs_logprob_diff_mean", "mismatch/abs_logprob_diff_max", "policy/ratio_mean"):
            assert key in r, key
        # fp32 engine vs fp32 trainer: the same weights, different kernels -> tiny but real mismatch
        assert 0 <= r["mismatch/abs_logprob_diff_max"] < 1e-3
        assert r["lr"] == pytest.approx(1e-2)
    assert {"eval/accuracy", "eval/pass@1"} <= set(records[5]) and "eval/accuracy" not in records[4]
    assert (tmp_path / "run" / "metrics.png").stat().st_size > 1000
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_000010"
    assert json.loads((tmp_path / "run" / "checkpoints" / "step_000010" / "trainer_state.json").read_text())["step"] == 10


@pytest.mark.slow
def test_single_update_takes_old_logprobs_from_the_training_forward(tmp_path, fresh_plugin_manager, monkeypatch) -> None:
    """With one update per rollout, skipping the old-logprob pass changes nothing but time: a run
    forced to make the pass (an off-policy setting that is inert here) trains the same."""
    fresh_plugin_manager.register_plugin(TestEnvironments(), "test-envs")
    config = str(write_tiny_config(tmp_path, steps=2, mini_batches=1))
    from skyrl_fsdp.backend import FSDPBackend

    forward_calls: list[int] = []
    original_forward = FSDPBackend.forward

    def counting_forward(self, batch, temperature=1.0):
        forward_calls.append(len(batch))
        return original_forward(self, batch, temperature)

    monkeypatch.setattr(FSDPBackend, "forward", counting_forward)
    runs, calls = {}, {}
    for name, extra in (("fused", []), ("separate", ["algorithm.off_policy.token_tis_cap=3.0"])):
        cfg = load_config(config, [f"trainer.output_dir={tmp_path / name}", *extra], plugin_manager=fresh_plugin_manager)
        forward_calls.clear()
        runs[name] = read_metrics(train(cfg, plugin_manager=fresh_plugin_manager).run_dir)[1:]
        calls[name] = sum(forward_calls)
    assert calls == {"fused": 0, "separate": 2 * 64}  # the separate pass scores every sample of both steps
    for fused, separate in zip(runs["fused"], runs["separate"]):
        assert fused["reward/mean"] == separate["reward/mean"]
        for key in ("loss", "grad_norm", "entropy", "mismatch/abs_logprob_diff_mean", "mismatch/abs_logprob_diff_max"):
            assert fused[key] == pytest.approx(separate[key], rel=1e-4, abs=1e-7), key
        assert fused["policy/ratio_max"] == 1.0  # the old policy is the current one
