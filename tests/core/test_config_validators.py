"""The shared option validators (``skyrl_core.config.validators``): one wording, bools are not
integers, and a choice lists what is allowed so the loader can suggest the closest value."""

from __future__ import annotations

import attrs
import pytest

from skyrl_core.config.loader import ConfigError, structure_config
from skyrl_core.config.validators import boolean, non_negative_int, one_of, optional_positive_int, positive_int


@attrs.frozen(kw_only=True)
class _Options:
    mode: str = attrs.field(default="a", validator=one_of("a", "b"))
    dtype: str | None = attrs.field(default=None, validator=one_of("fp32", "bf16", optional=True))
    ranks: int = attrs.field(default=1, validator=positive_int)
    threads: int | None = attrs.field(default=None, validator=optional_positive_int)
    skip: int = attrs.field(default=0, validator=non_negative_int)
    fast: bool = attrs.field(default=True, validator=boolean)


@pytest.mark.parametrize(("given", "message"), [
    ({"mode": "c"}, "_Options.mode must be one of a, b; got 'c'"),
    ({"dtype": "fp8"}, "_Options.dtype must be one of fp32, bf16 or null; got 'fp8'"),
    ({"ranks": 0}, "_Options.ranks must be an integer >= 1; got 0"),
    ({"ranks": True}, "_Options.ranks must be an integer >= 1; got True"),
    ({"threads": 0}, "_Options.threads must be a positive integer or null; got 0"),
    ({"threads": False}, "_Options.threads must be a positive integer or null; got False"),
    ({"skip": -1}, "_Options.skip must be an integer >= 0; got -1"),
    ({"skip": 1.5}, "_Options.skip must be an integer >= 0; got 1.5"),
    ({"fast": 1}, "_Options.fast must be true or false; got 1"),
])
def test_each_validator_refuses_naming_field_value_and_what_is_allowed(given, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _Options(**given)


def test_accepted_values_pass():
    assert _Options(mode="b", dtype=None, ranks=2, threads=None, skip=0, fast=False).ranks == 2
    assert _Options(dtype="bf16", threads=3).threads == 3


def test_a_plugin_choice_gets_the_allowed_list_and_a_suggestion_from_the_loader():
    # The torch engine's choices once had validators without ``allowed``: no list, no suggestion.
    with pytest.raises(ConfigError) as info:
        structure_config({"model": {"config": {"model_type": "llama"}},
                          "engine": {"name": "torch", "options": {"implementation": "natve"}}})
    text = str(info.value)
    assert "engine.options.implementation: 'natve' is invalid: implementation must be one of auto, native" in text
    assert "allowed: auto, native, transformers" in text and "did you mean 'native'?" in text


def test_generation_top_p_is_a_probability_mass(tmp_path):
    """``generation.top_p`` above 1 was accepted and failed later in the engine, after the run began."""
    from skyrl_core.config.loader import load_config

    path = tmp_path / "c.yaml"
    path.write_text("model: {config: {model_type: qwen3}}\n")
    with pytest.raises(ConfigError, match=r"generation.top_p: 1.5 is invalid: must be in \(0, 1\]"):
        load_config(str(path), ["generation.top_p=1.5"])
    assert load_config(str(path), ["generation.top_p=1.0"]).generation.top_p == 1.0


def test_sections_given_as_mappings_in_python_are_built_and_checked():
    """``AlgorithmConfig(kl={...})`` from Python: the mapping becomes the section's class, checked as
    the loader checks it; it was kept as a raw dict, so a misspelt key or a bad value passed."""
    from skyrl_core.config.schema import AlgorithmConfig, Config, KLConfig

    assert AlgorithmConfig(kl={"coef": 0.1}).kl == KLConfig(coef=0.1)
    with pytest.raises(ValueError, match="KLConfig: unknown key 'coeff'; allowed: estimator, use_as, coef"):
        AlgorithmConfig(kl={"coeff": 0.1})
    with pytest.raises(ValueError, match=r"AlgorithmConfig\.kl must be a mapping of KLConfig options; got 'x'"):
        AlgorithmConfig(kl="x")
    config = Config(model={"path": None, "config": {"model_type": "qwen3"}}, trainer={"lr": 1e-5})
    assert config.trainer.lr == 1e-5 and config.model.config == {"model_type": "qwen3"}
    for bad in ("fast", float("nan"), True):  # (each compared as no bound means: accepted before)
        with pytest.raises(ValueError, match="must be a number"):
            Config(model={"config": {}}, trainer={"lr": bad})
