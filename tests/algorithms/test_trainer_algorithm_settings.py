"""The RL trainer applies the algorithm settings for real (tiny model, a few steps): the policy loss's
own reduction reaches the reduction weights, and dynamic sampling resamples within its limit."""

from __future__ import annotations

from skyrl_core.config.loader import load_config
from skyrl_core.trainer import rl
from skyrl_core.trainer.metrics import read_metrics
from tests.e2e.tiny_run import write_tiny_config
from tests.rollout.envs import TestEnvironments


def test_gspo_reduces_with_its_own_sequence_mean_and_dynamic_sampling_refills(tmp_path, fresh_plugin_manager, monkeypatch):
    fresh_plugin_manager.register_plugin(TestEnvironments(), "test-envs")
    seen: list[tuple[str, int | None]] = []
    original = rl.reduction_weights

    def recording(loss_mask, reduction, group_ids=None, norm_len=None, micro_batch_size=None):
        seen.append((reduction, micro_batch_size))
        return original(loss_mask, reduction, group_ids, norm_len, micro_batch_size=micro_batch_size)

    monkeypatch.setattr(rl, "reduction_weights", recording)
    config = write_tiny_config(tmp_path, steps=2, mini_batches=1)
    cfg = load_config(str(config), ["algorithm.policy_loss=gspo", "algorithm.dynamic_sampling.mode=resample",
                                    "algorithm.dynamic_sampling.max_sample_batches=3", "data.eval=null"],
                      plugin_manager=fresh_plugin_manager)
    records = read_metrics(rl.train(cfg, plugin_manager=fresh_plugin_manager).run_dir)
    steps = [r for r in records if r["step"] > 0]
    assert len(steps) == 2
    trained = [r for r in steps if "skipped" not in r]
    assert trained and {reduction for reduction, _ in seen} == {"sequence_mean"}
    for r in steps:
        assert 1 <= r["dynamic_sampling/batches"] <= 3
        assert r["dynamic_sampling/groups"] <= 8  # data.prompts_per_step
        # it stops early only with a full step
        assert r["dynamic_sampling/batches"] == 3 or r["dynamic_sampling/groups"] == 8
