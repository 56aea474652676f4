"""The algorithms as a built-in plugin: records, lazy imports, and the public loaders."""

from __future__ import annotations

import json
import subprocess
import sys

import attrs
import pytest
import torch

import skyrl_core
from skyrl_core.algorithms import options as O
from skyrl_core.algorithms import plugin
from skyrl_core.algorithms.advantages import AdvantageEstimatorFn
from skyrl_core.algorithms.policy_losses import PolicyLossFn, make_ppo
from skyrl_core.config.errors import ConfigError
from skyrl_core.plugins.records import AdvantageEstimatorSpec, PolicyLossSpec
from tests.algorithms.reference import tensors

POLICY_LOSSES = {"ppo", "dual_clip", "gspo", "cispo", "sapo", "clip_cov", "kl_cov", "rollout_is", "dppo",
                 "cross_entropy", "importance_sampling", "dro"}
ESTIMATORS = {"gae", "grpo", "rloo", "reinforce++", "maxrl"}


def records():
    got = []
    plugin.skyrl_register_algorithms(got.append)
    return got


def test_every_algorithm_is_registered_with_a_loadable_factory_and_options():
    recs = records()
    assert {r.name for r in recs if isinstance(r, PolicyLossSpec)} == POLICY_LOSSES
    assert {r.name for r in recs if isinstance(r, AdvantageEstimatorSpec)} == ESTIMATORS
    for rec in recs:
        assert rec.description
        built = rec.load_factory()(rec.load_options_class()())
        assert built.name == rec.name
        assert isinstance(built, PolicyLossFn if isinstance(rec, PolicyLossSpec) else AdvantageEstimatorFn)


def test_registering_imports_no_torch():
    code = (
        "import sys\n"
        "import skyrl_core.algorithms.plugin as p\n"
        "recs = []\n"
        "p.skyrl_register_algorithms(recs.append)\n"
        "[r.load_options_class() for r in recs]\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_plugins_list_shows_every_name_under_the_core_builtins():
    out = subprocess.run([sys.executable, "-m", "skyrl_core", "plugins", "list", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    row = next(r for r in json.loads(out.stdout) if r["name"] == "core.algorithms")
    assert row["kind"] == "builtin" and row["status"] == "ok"
    assert set(row["provides"]) == {f"policy_loss:{n}" for n in POLICY_LOSSES} | {
        f"advantage_estimator:{n}" for n in ESTIMATORS}


def test_load_policy_loss_structures_options():
    loss_fn = skyrl_core.load_policy_loss("ppo", eps_low=0.1)
    assert loss_fn.options == O.PPOOptions(eps_low=0.1)
    logp, old, adv, mask, _ = tensors()
    got, _ = loss_fn(logp, old, adv, mask)
    want, _ = make_ppo(O.PPOOptions(eps_low=0.1))(logp, old, adv, mask)
    default, _ = make_ppo()(logp, old, adv, mask)
    assert got.item() == want.item() and got.item() != default.item()


def test_load_policy_loss_rejects_bad_options_with_the_key_path():
    with pytest.raises(ConfigError, match=r"policy_loss:ppo\.eps_low: 1\.5 is invalid: eps_low must be in \(0, 1\]"):
        skyrl_core.load_policy_loss("ppo", eps_low=1.5)
    with pytest.raises(ConfigError, match=r"(?s)policy_loss:ppo\.eps_lo: unknown key.*did you mean 'eps_low'"):
        skyrl_core.load_policy_loss("ppo", eps_lo=0.1)
    with pytest.raises(ConfigError, match=r"loss_reduction.*must be one of token_mean, sequence_mean"):
        skyrl_core.load_policy_loss("gspo", loss_reduction="mean")
    with pytest.raises(ConfigError, match="cov_low must be <= cov_high"):
        skyrl_core.load_policy_loss("clip_cov", cov_low=2.0, cov_high=1.0)


def test_load_advantage_estimator():
    est = skyrl_core.load_advantage_estimator("grpo", norm_by_std=False)
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 3.0]])
    adv, _ = est(rewards, torch.ones(3, 2), ["p", "p", "p"])
    assert adv[:, 0].tolist() == pytest.approx([1 - 4 / 3, -4 / 3, 3 - 4 / 3])  # mean 4/3, no std
    assert skyrl_core.load_advantage_estimator("reinforce++", gamma=0.5).options.gamma == 0.5
    # 0 is a valid discount and lambda (upstream SkyRL accepts them: one-step TD, no future reward)
    assert skyrl_core.load_advantage_estimator("gae", lam=0, gamma=0).options.lam == 0
    with pytest.raises(ConfigError, match=r"advantage_estimator:gae\.lam: 1\.5 is invalid: lam must be in \[0, 1\]"):
        skyrl_core.load_advantage_estimator("gae", lam=1.5)
    with pytest.raises(ConfigError, match=r"advantage_estimator:reinforce\+\+\.gamma: -0\.1 is invalid"):
        skyrl_core.load_advantage_estimator("reinforce++", gamma=-0.1)


def test_options_validate_directly():
    with pytest.raises(ValueError, match=r"DualClipOptions\.clip_ratio_c must be > 1, got 1\.0"):
        O.DualClipOptions(clip_ratio_c=1.0)
    with pytest.raises(ValueError, match=r"DPPOOptions\.divergence must be one of binary_tv, binary_kl; got 'tv'"):
        O.DPPOOptions(divergence="tv")
    with pytest.raises(ValueError, match=r"PPOOptions\.norm_len must be a positive integer or null"):
        O.PPOOptions(norm_len=0)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        O.PPOOptions().eps_low = 0.3  # type: ignore[misc]


def test_docs_have_a_section_per_algorithm_with_its_true_defaults():
    """docs/algorithms.md names every registered algorithm, and every `option=default` it writes in a
    section matches the options class; every option (bar the shared reduction ones) is documented."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "algorithms.md").read_text()
    for rec in records():
        match = re.search(rf"^### `{re.escape(rec.name)}`\n(.*?)(?=^##)", text, re.S | re.M)
        assert match, f"no section for {rec.name}"
        documented = dict(re.findall(r"`(\w+)=([^`]+)`", match.group(1)))
        fields = {f.name: f.default for f in attrs.fields(rec.load_options_class())}
        for name, default in fields.items():
            if name in ("loss_reduction", "norm_len") and name not in documented:
                continue
            assert name in documented, f"{rec.name}: option {name} is not documented"
            written = documented[name]
            if default is None:
                assert written == "null", (rec.name, name)
            elif isinstance(default, bool):
                assert written == str(default).lower(), (rec.name, name)
            elif isinstance(default, str):
                assert written == f'"{default}"', (rec.name, name)
            else:
                assert float(written) == default, (rec.name, name, written, default)
