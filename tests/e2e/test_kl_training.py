"""KL to the initial policy, as a loss term and as a reward penalty, with its controllers."""

from __future__ import annotations

import pytest

from skyrl_core.config.loader import load_config
from skyrl_core.trainer.metrics import read_metrics
from skyrl_core.trainer.rl import train
from tests.e2e.tiny_run import write_tiny_config
from tests.rollout.envs import TestEnvironments


@pytest.mark.slow
@pytest.mark.parametrize("use_as, extra", [("loss", []), ("reward", ["algorithm.kl.adaptive_target=0.01"])])
def test_kl_to_the_initial_policy_grows_from_zero(tmp_path, fresh_plugin_manager, use_as, extra) -> None:
    fresh_plugin_manager.register_plugin(TestEnvironments(), "test-envs")
    config = str(write_tiny_config(tmp_path, steps=3, mini_batches=1))
    cfg = load_config(config, ["data.eval=null", f"algorithm.kl.use_as={use_as}", "algorithm.kl.coef=0.1", *extra],
                      plugin_manager=fresh_plugin_manager)
    records = read_metrics(train(cfg, plugin_manager=fresh_plugin_manager).run_dir)
    kl = [r["kl"] for r in records]
    # the policy starts as the reference (same seed, same weights): KL ~0, then it moves away
    assert kl[0] < 1e-6 and kl[2] > kl[0] and kl[2] > 1e-5
    coefs = [r["kl_coef"] for r in records]
    if extra:  # adaptive: the coefficient follows the step's KL against the 0.01 target
        for previous, coef, step_kl in zip([0.1, *coefs], coefs, kl):
            assert (coef > previous) == (step_kl > 0.01) and coef != previous
    else:
        assert coefs == [0.1, 0.1, 0.1]
