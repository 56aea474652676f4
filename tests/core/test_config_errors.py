"""Bad configs: each is refused before anything runs, with exit code 2 and a message naming the key
path, what was given and what is allowed. The texts are compared with golden files
(regenerate with SKYRL_UPDATE_GOLDEN=1 after an intended change, and review the diff)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import run_skyrl

GOLDEN = Path(__file__).parent / "golden"

TINY_MODEL = """model:
  config: {model_type: qwen3, vocab_size: 512, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2,
           num_attention_heads: 4, num_key_value_heads: 2, head_dim: 32}
"""

# name -> (config text or None for "no such file", overrides)
BAD_CONFIGS: dict[str, tuple[str | None, list[str]]] = {
    "unknown_top_level_key": (TINY_MODEL + "trainr: {steps: 3}\n", []),
    "typo_in_nested_key": (TINY_MODEL + "trainer: {lrr: 1.0e-5}\n", []),
    "wrong_type": (TINY_MODEL + "trainer: {steps: ten}\n", []),
    "unknown_engine_name": (TINY_MODEL + "engine: {name: vlm}\n", []),
    "bad_option_of_a_plugin": (TINY_MODEL + "algorithm: {policy_loss: {name: ppo, options: {eps_lw: 0.1}}}\n", []),
    "missing_file": (None, []),
    "invalid_yaml": (TINY_MODEL + "trainer: {steps: 3\n", []),
    "value_not_allowed": (TINY_MODEL + "algorithm: {loss_reduction: token-mean}\n", []),
    "model_neither_path_nor_config": ("model: {dtype: float32}\n", []),
    "bad_override_value": (TINY_MODEL, ["trainer.steps=0", "generation.temperature=hot"]),
    "unknown_policy_loss": (TINY_MODEL + "algorithm: {policy_loss: {name: ppo_clip}}\n", []),
    "malformed_override": (TINY_MODEL, ["trainer.steps"]),
    "plugin_section_wrong_type": (TINY_MODEL + "isoexec: {enabled: maybe}\n", []),
    "unknown_environment": (TINY_MODEL + "environment: sqll\n", []),
}


@pytest.mark.parametrize("name", sorted(BAD_CONFIGS))
def test_bad_config_is_refused_with_golden_message(name, tmp_path):
    text, overrides = BAD_CONFIGS[name]
    path = tmp_path / f"{name}.yaml"
    if text is not None:
        path.write_text(text)
    result = run_skyrl("config", "show", str(path), *overrides)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    message = result.stderr.replace(str(tmp_path), "<tmp>")
    assert len(message.splitlines()) <= 24  # one screen
    golden = GOLDEN / f"{name}.txt"
    if os.environ.get("SKYRL_UPDATE_GOLDEN"):
        golden.write_text(message)
    assert message == golden.read_text()


def test_a_good_config_resolves_with_defaults_filled(tmp_path):
    path = tmp_path / "good.yaml"
    path.write_text(TINY_MODEL + "trainer: {steps: 3}\n")
    result = run_skyrl("config", "show", str(path), "trainer.lr=2e-5", "engine=torch", "--json")
    assert result.returncode == 0, result.stderr
    import json

    data = json.loads(result.stdout)
    assert data["trainer"]["steps"] == 3
    assert data["trainer"]["lr"] == 2e-5
    assert data["engine"]["name"] == "torch"
    assert data["algorithm"]["policy_loss"]["name"] == "ppo"
    assert isinstance(data["engine"]["options"], dict) and data["engine"]["options"]  # plugin defaults filled
