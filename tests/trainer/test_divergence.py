"""A run stops at the first non-finite loss or gradient norm, naming the step and the value, before
the optimizer applies it and without writing a checkpoint."""

from __future__ import annotations

import math

import pytest
import torch

from skyrl_core.config.loader import load_config
from skyrl_core.plugins import hookimpl
from skyrl_core.plugins.records import PolicyLossSpec
from skyrl_core.trainer.divergence import NonFiniteTrainingError, check_finite, check_weights_finite
from skyrl_core.trainer.rl import train
from tests.e2e.tiny_run import write_tiny_config
from tests.rollout.envs import TestEnvironments


def test_check_finite_names_the_step_and_the_value() -> None:
    check_finite(1, "loss", 0.5)
    check_finite(1, "gradient norm", None)  # not reported: nothing to check
    with pytest.raises(NonFiniteTrainingError, match=r"^training step 7: the gradient norm is inf \(not finite\)"):
        check_finite(7, "gradient norm", math.inf)
    weights = [("a", torch.zeros(2)), ("b", torch.tensor([1.0, math.nan])), ("c", torch.tensor([math.inf]))]
    with pytest.raises(NonFiniteTrainingError, match=r"weight 'b' holds NaN or inf"):
        check_weights_finite(3, weights)
    check_weights_finite(3, [("ids", torch.tensor([1, 2]))])


class NaNLoss:
    """Loss NaN: what lr=inf or a broken reward would give."""

    def __init__(self, options=None) -> None:
        self.options = options

    def __call__(self, logprobs, old_logprobs, advantages, loss_mask, rollout_logprobs=None, **kw):
        return (logprobs * loss_mask).sum() * math.nan, {}


class NaNGradient(NaNLoss):
    """Loss 0 (finite), gradient NaN: sqrt'(0) is inf, times the 0 of the chain rule."""

    def __call__(self, logprobs, old_logprobs, advantages, loss_mask, rollout_logprobs=None, **kw):
        return torch.sqrt((logprobs * loss_mask * 0.0).abs()).sum(), {}


class DivergingLosses:
    @hookimpl
    def skyrl_register_algorithms(self, register):
        register(PolicyLossSpec(name="nan_loss", factory=f"{__name__}:NaNLoss"))
        register(PolicyLossSpec(name="nan_gradient", factory=f"{__name__}:NaNGradient"))


@pytest.mark.parametrize(("loss", "what"), [("nan_loss", "loss"), ("nan_gradient", "gradient norm")])
def test_a_non_finite_step_stops_the_run_before_the_optimizer_and_the_checkpoint(
    loss, what, tmp_path, fresh_plugin_manager, monkeypatch
) -> None:
    from skyrl_fsdp.backend import FSDPBackend

    fresh_plugin_manager.register_plugin(TestEnvironments(), "test-envs")
    fresh_plugin_manager.register_plugin(DivergingLosses(), "diverging-losses")
    config = write_tiny_config(tmp_path, steps=2, mini_batches=1, checkpoint_every=1)
    cfg = load_config(str(config), ["data.eval=null", f"algorithm.policy_loss={loss}"], plugin_manager=fresh_plugin_manager)
    exported: list[dict[str, torch.Tensor]] = []
    original_optim_step = FSDPBackend.optim_step

    def optim_step_then_weights(self):
        out = original_optim_step(self)
        exported.append(dict(self.export_weights()))
        return out

    monkeypatch.setattr(FSDPBackend, "optim_step", optim_step_then_weights)
    with pytest.raises(NonFiniteTrainingError, match=rf"^training step 1: the {what} is nan \(not finite\); the run stopped"):
        train(cfg, plugin_manager=fresh_plugin_manager)
    assert not (tmp_path / "run" / "checkpoints").exists()
    if what == "gradient norm":  # the optimizer step was skipped: weights are finite
        assert exported and all(bool(torch.isfinite(t).all()) for t in exported[-1].values())
    else:
        assert exported == []  # stopped before the optimizer step
