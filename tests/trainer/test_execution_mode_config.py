"""``trainer.mode``: an accepted value must run what it names; a mode not built yet is refused
with its key path and the values built now."""

from __future__ import annotations

import pytest

from skyrl_core.config.loader import ConfigError, structure_config

TINY = {"model": {"config": {"model_type": "llama"}}}


def _load(mode: str):
    return structure_config({**TINY, "trainer": {"mode": mode}})


def test_sync_is_accepted():
    assert _load("sync").trainer.mode == "sync"


@pytest.mark.parametrize("mode", ["one_step_off", "fully_async"])
def test_unbuilt_mode_is_refused_plainly(mode):
    with pytest.raises(ConfigError) as err:
        _load(mode)
    text = str(err.value)
    assert "trainer.mode" in text and f"'{mode}' is not built yet" in text and "allowed: sync" in text


def test_unknown_mode_is_refused():
    with pytest.raises(ConfigError, match="trainer.mode"):
        _load("async")
