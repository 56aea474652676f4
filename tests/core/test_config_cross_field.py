"""Validators that compare fields see the other fields' values (given or default), with key paths."""

from __future__ import annotations

import attrs
import pytest

from skyrl_core.config.errors import ConfigError
from skyrl_core.config.loader import structure_options
from skyrl_core.plugins.records import EnvironmentSpec


def _at_least_low(instance, attribute, value):
    if value < instance.low:
        raise ValueError(f"high ({value}) must be >= low ({instance.low})")


@attrs.frozen(kw_only=True)
class RangeOptions:
    low: int = 0
    high: int = attrs.field(default=10, validator=_at_least_low)


SPEC = EnvironmentSpec(name="ranged", factory="x:y", options=f"{__name__}:RangeOptions")


def test_cross_field_validator_uses_given_and_default_values():
    assert structure_options(SPEC, {"high": 5}, "environment.options") == RangeOptions(low=0, high=5)
    with pytest.raises(ConfigError) as info:
        structure_options(SPEC, {"low": 7, "high": 5}, "environment.options")
    assert "environment.options.high: 5 is invalid: high (5) must be >= low (7)" in str(info.value)
