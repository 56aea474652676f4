"""Algorithm settings in config: which loss reduction applies, contradictions refused, new keys
validated with their key path, token_mean_legacy, gamma/lambda of 0."""

from __future__ import annotations

import pytest
import torch

from skyrl_core.algorithms import options as O
from skyrl_core.algorithms.advantages import make_gae, make_reinforce_plus_plus
from skyrl_core.algorithms.precedence import effective_loss_reduction
from skyrl_core.algorithms.reductions import reduction_weights
from skyrl_core.config.errors import ConfigError
from skyrl_core.config.loader import structure_config

MODEL = {"model": {"path": "/nonexistent"}}


def load(algorithm: dict):
    return structure_config({**MODEL, "algorithm": algorithm})


def effective(algorithm: dict) -> str:
    cfg = load(algorithm)
    return effective_loss_reduction(cfg.algorithm.loss_reduction, cfg.algorithm.policy_loss.options)


def test_gspo_gets_its_own_sequence_mean_unless_told_otherwise():
    assert effective({"policy_loss": "gspo"}) == "sequence_mean"
    assert effective({"policy_loss": "ppo"}) == "token_mean"
    # algorithm.loss_reduction applies to a loss that does not set its own
    assert effective({"policy_loss": "gspo", "loss_reduction": "token_mean"}) == "token_mean"
    assert effective({"policy_loss": "ppo", "loss_reduction": "prompt_mean"}) == "prompt_mean"
    # the loss's option applies; agreeing settings are fine
    assert effective({"policy_loss": {"name": "ppo", "options": {"loss_reduction": "sequence_mean"}}}) == "sequence_mean"
    assert effective({"policy_loss": {"name": "gspo", "options": {"loss_reduction": "token_mean"}},
                      "loss_reduction": "token_mean"}) == "token_mean"


def test_contradicting_reductions_are_a_config_error_with_both_key_paths():
    with pytest.raises(ConfigError) as info:
        load({"policy_loss": {"name": "gspo", "options": {"loss_reduction": "sequence_mean"}},
              "loss_reduction": "token_mean"})
    text = str(info.value)
    assert "algorithm.loss_reduction='token_mean' contradicts" in text
    assert "algorithm.policy_loss.options.loss_reduction='sequence_mean'" in text


def test_cispo_rollout_anchor_refuses_tis_on_top():
    load({"policy_loss": {"name": "cispo", "options": {"anchor": "rollout"}}})
    with pytest.raises(ConfigError, match="correct the mismatch twice"):
        load({"policy_loss": {"name": "cispo", "options": {"anchor": "rollout"}}, "off_policy": {"tis": "token"}})


def test_new_keys_are_validated_with_their_key_path():
    with pytest.raises(ConfigError, match=r"algorithm\.off_policy\.geo_mask_high: 0\.9 is invalid: must be >= geo_mask_low"):
        load({"off_policy": {"geo_mask_high": 0.9}})
    with pytest.raises(ConfigError, match=r"algorithm\.dynamic_sampling\.mode: 'filter' is invalid"):
        load({"dynamic_sampling": {"mode": "filter"}})
    with pytest.raises(ConfigError, match=r"algorithm\.dynamic_sampling\.max_sample_batches: 0 is invalid"):
        load({"dynamic_sampling": {"max_sample_batches": 0}})
    with pytest.raises(ConfigError, match=r"algorithm\.dynamic_sampling\.zero_variance_tol: -1 is invalid"):
        load({"dynamic_sampling": {"zero_variance_tol": -1}})
    with pytest.raises(ConfigError, match=r"algorithm\.off_policy\.tis_cap: unknown key"):
        load({"off_policy": {"tis_cap": 2.0}})
    cfg = load({"loss_reduction": "token_mean_legacy", "dynamic_sampling": {"mode": "resample", "zero_variance_tol": 1e-6},
                "off_policy": {"outlier_token_low": 1e-4, "outlier_token_high": 100, "sequence_tis_cap": 8}})
    assert cfg.algorithm.dynamic_sampling.mode == "resample"
    assert cfg.algorithm.off_policy.sequence_tis_cap == 8.0


def test_token_mean_legacy_is_a_token_mean_per_micro_batch():
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.float64)
    w = reduction_weights(mask, "token_mean_legacy", micro_batch_size=2)
    # micro-batch rows 0-1: 4 tokens, rows 2: 2 tokens; two micro-batches
    assert w.tolist() == [[1 / 8, 1 / 8, 1 / 8], [1 / 8, 0, 0], [1 / 4, 1 / 4, 0]]
    assert w.sum().item() == pytest.approx(1.0)
    # one micro-batch: exactly token_mean; it differs from token_mean as soon as there are two
    assert torch.equal(reduction_weights(mask, "token_mean_legacy"), reduction_weights(mask, "token_mean"))
    assert not torch.allclose(w, reduction_weights(mask, "token_mean"))
    with pytest.raises(ValueError, match="micro_batch_size must be a positive integer"):
        reduction_weights(mask, "token_mean_legacy", micro_batch_size=0)


def test_gamma_and_lambda_of_zero():
    """Upstream SkyRL's GAE recursion with gamma = 0 or lambda = 0, written out: gamma 0 makes A_t
    the immediate reward minus V_t; lambda 0 makes it the one-step TD error."""
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.2, 0.4]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    adv, ret = make_gae(O.GAEOptions(gamma=0.0, lam=1.0, whiten=False))(rewards, mask, ["g"], values)
    assert adv.tolist() == [[-0.5, -0.2, 0.6]] and ret.tolist() == [[0.0, 0.0, 1.0]]
    adv, _ = make_gae(O.GAEOptions(gamma=1.0, lam=0.0, whiten=False))(rewards, mask, ["g"], values)
    assert adv[0].tolist() == pytest.approx([0.2 - 0.5, 0.4 - 0.2, 1.0 - 0.4])
    _, returns = make_reinforce_plus_plus(O.ReinforcePlusPlusOptions(gamma=0.0))(rewards, mask, ["g"])
    assert returns.tolist() == [[0.0, 0.0, 1.0]]
