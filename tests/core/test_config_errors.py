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
    _assert_golden(name, run_skyrl("config", "show", str(path), *overrides), tmp_path)


def _assert_golden(name, result, tmp_path) -> None:
    """Exit 2, nothing on stdout, no traceback, one screen, the golden text."""
    assert result.returncode == 2, result.stderr
    assert result.stdout == "" and "Traceback" not in result.stderr
    message = result.stderr.replace(str(tmp_path), "<tmp>")
    assert len(message.splitlines()) <= 24  # one screen
    golden = GOLDEN / f"{name}.txt"
    if os.environ.get("SKYRL_UPDATE_GOLDEN"):
        golden.write_text(message)
    assert message == golden.read_text()


def test_a_good_config_resolves_with_defaults_filled(tmp_path):
    path = tmp_path / "good.yaml"
    path.write_text(TINY_MODEL + "trainer: {steps: 3}\n")
    result = run_skyrl("config", "show", str(path), "trainer.lr=2e-5", "engine=torch", "--json", "--skip-checks")
    assert result.returncode == 0, result.stderr
    import json

    data = json.loads(result.stdout)
    assert data["trainer"]["steps"] == 3
    assert data["trainer"]["lr"] == 2e-5
    assert data["engine"]["name"] == "torch"
    assert data["algorithm"]["policy_loss"]["name"] == "ppo"
    assert isinstance(data["engine"]["options"], dict) and data["engine"]["options"]  # plugin defaults filled


# --- hostile configs: each is one clear sentence and exit 2, never a traceback ----------------------

ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(8)
)


def _write(path, content) -> None:
    if content is None:
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)


# name -> (file content: str, bytes, or None for "a directory", overrides)
HOSTILE_CONFIGS: dict[str, tuple[str | bytes | None, list[str]]] = {
    "config_is_a_directory": (None, []),
    "not_utf8": (b"trainer: {lr: 1.0e-5}\n# caf\xe9\n", []),
    "deep_nesting": ("a: " + "[" * 20000 + "]" * 20000 + "\n", []),
    "integer_of_5000_digits": (TINY_MODEL + "trainer: {seed: " + "9" * 5000 + "}\n", []),
    "yaml_alias_bomb": (ALIAS_BOMB, []),
    "recursive_alias": ("a: &a [*a]\n", []),
    "non_finite_floats": (TINY_MODEL + "trainer: {lr: .inf, grad_clip: .nan}\n", []),
    "non_finite_overrides": (TINY_MODEL, ["trainer.lr=1e400", "generation.top_p=-.inf"]),
    "non_finite_plugin_option": (TINY_MODEL + "algorithm: {policy_loss: {name: ppo, options: {eps_low: .nan}}}\n", []),
    "non_finite_in_free_form": ("model: {config: {model_type: qwen3, rms_norm_eps: .nan}}\n", []),
    "integer_beyond_64_bits": (TINY_MODEL + "trainer: {seed: 99999999999999999999999}\n", []),
    "negative_counts": (TINY_MODEL + "trainer: {steps: -3, micro_batch_size: -1, eval_every: -2}\n", []),
    "wrong_types_in_lists": (TINY_MODEL + "generation: {stop: [1, [2]]}\n", []),
    "keys_with_dots": (TINY_MODEL + "trainer.lr: 1.0e-5\n", []),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_CONFIGS))
def test_hostile_config_is_one_clear_message(name, tmp_path):
    content, overrides = HOSTILE_CONFIGS[name]
    path = tmp_path / f"{name}.yaml"
    _write(path, content)
    _assert_golden(name, run_skyrl("config", "show", str(path), *overrides, "--skip-checks", timeout=60), tmp_path)


def test_config_show_runs_the_checks_train_runs_and_takes_resume(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(TINY_MODEL + f"data: {{train: {tmp_path / 'missing.jsonl'}}}\ntrainer: {{output_dir: {tmp_path / 'run'}}}\n")
    result = run_skyrl("config", "show", str(path), f"resume={tmp_path / 'nothing'}")
    assert result.returncode == 2
    assert "data.train: dataset file" in result.stderr and "does not exist" in result.stderr
    assert f"trainer.resume: '{tmp_path / 'nothing'}' is neither a checkpoint" in result.stderr
    assert result.stdout == ""


def test_a_known_component_that_is_not_installed_names_its_package(builtin_plugin_manager):
    from skyrl_core.config.errors import ConfigError
    from skyrl_core.config.loader import structure_config

    with pytest.raises(ConfigError) as info:
        structure_config({"model": {"config": {"model_type": "qwen3"}}, "engine": "torch", "backend": "fsdp",
                          "environment": "gsm8k", "isoexec": {"enabled": True}}, plugin_manager=builtin_plugin_manager)
    text = info.value.render()
    assert "engine.name: 'torch' is provided by skyrl-torch (pip install skyrl-torch), which is not installed" in text
    assert "backend.name: 'fsdp' is provided by skyrl-fsdp (pip install skyrl-fsdp), which is not installed" in text
    assert "environment.name: 'gsm8k' is provided by skyrl-envs" in text
    assert "isoexec: unknown key: a section provided by skyrl-isoexec (pip install skyrl-isoexec)" in text
