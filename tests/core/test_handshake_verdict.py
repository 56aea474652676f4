"""The core's handshake: plugins answer with typed verdicts, combined so that one plugin's mismatch
overrules another's vouching; a plugin answering with anything else is named."""

from __future__ import annotations

import pluggy
import pytest

from skyrl_core.plugins import hookimpl
from skyrl_core.plugins.manager import get_plugin_manager
from skyrl_core.trainer.runtime import HandshakeError, handshake
from skyrl_core.types import HandshakeVerdict


class _Runtime:
    def execution_contract(self):
        return {"ledger": None}


class _Answer:
    def __init__(self, answer):
        self.answer = answer

    @hookimpl
    def skyrl_verify_handshake(self, trainer_contract, engine_contract):
        return self.answer


def _handshake(*answers):
    pm = get_plugin_manager()
    registered = []
    for i, answer in enumerate(answers):
        plugin = _Answer(answer)
        pm.register(plugin, name=f"answer-{i}")
        registered.append(plugin)
    try:
        return handshake(pm, _Runtime(), _Runtime())
    finally:
        for plugin in registered:
            pm.unregister(plugin)


def test_combine_needs_every_plugin_to_agree():
    vouch = HandshakeVerdict(identical_logprobs=True, reuse_rollout_logprobs=True)
    combined = HandshakeVerdict.combine([vouch, HandshakeVerdict()])
    assert (combined.identical_logprobs, combined.reuse_rollout_logprobs) == (True, True)
    assert HandshakeVerdict.combine([]) == HandshakeVerdict()


def test_a_vouch_cannot_be_made_without_identical_logprobs():
    with pytest.raises(ValueError, match="needs identical_logprobs"):
        HandshakeVerdict(reuse_rollout_logprobs=True)


def test_a_mismatch_from_one_plugin_stops_the_sync_whatever_another_vouches():
    vouch = HandshakeVerdict(identical_logprobs=True, reuse_rollout_logprobs=True)
    with pytest.raises(HandshakeError, match="linear @ engine_decode: differs"):
        _handshake(vouch, HandshakeVerdict(mismatches=["linear @ engine_decode: differs"]))


def test_handshake_returns_the_combined_verdict():
    vouch = HandshakeVerdict(identical_logprobs=True, reuse_rollout_logprobs=True)
    assert _handshake(vouch, None).reuse_rollout_logprobs is True


def test_an_untyped_answer_is_an_error_naming_the_plugin():
    with pytest.raises(TypeError, match="plugin 'answer-0'.*returned a list"):
        _handshake(["a mismatch as a bare list"])
