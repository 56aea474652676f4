"""An engine in its own (Ray actor) process: weights synced by broadcast over a gloo pair and by a
checkpoint directory end bit-equal to the trainer's (SHA-256 of the raw bytes; negative control:
different before the sync); pause/resume and version stamps across the process boundary; a killed
engine process is reported within seconds, by name."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from skyrl_core.config.schema import ModelConfig, Selection
from skyrl_core.engine_actor import EngineProcessError, RemoteEngine
from skyrl_core.models import load_causal_lm
from skyrl_core.testing.engine_contract import TINY_QWEN3, request
from skyrl_core.weight_sync import weights_digest

def test_engine_actor_in_process_takes_weights_by_broadcast_and_checkpoint_bit_equal(tmp_path):
    """The actor's side without Ray (the same object Ray hosts): a trainer thread broadcasts."""
    import threading

    from skyrl_core.engine_actor import EngineActor
    from skyrl_core.weight_sync import GlooPairHost, manifest_of, send_by_broadcast, write_checkpoint

    model = ModelConfig(config=dict(TINY_QWEN3))
    actor = EngineActor(Selection(name="torch"), model, 0, {})
    try:
        trainer = load_causal_lm(model, seed=1).state_dict()
        assert actor.weights_digest() != weights_digest(trainer.items())  # negative control
        actor.update_from_checkpoint(write_checkpoint(str(tmp_path), trainer.items(), version=1), 1)
        assert actor.weights_digest() == weights_digest(trainer.items())
        moved = {n: t * 1.5 for n, t in trainer.items()}
        host = GlooPairHost("127.0.0.1", timeout_s=60)
        joined = threading.Thread(target=actor.join_broadcast, args=("127.0.0.1", host.port))
        joined.start()
        group = host.group()
        joined.join()
        receiving = threading.Thread(target=actor.update_from_broadcast, args=(manifest_of(moved.items()), 2))
        receiving.start()
        send_by_broadcast(group, moved.items())
        receiving.join(timeout=60)
        assert actor.weights_digest() == weights_digest(moved.items())
        sample = actor.generate([request((1, 2, 3), "r", max_tokens=4, seed=0)])[0][0]
        assert list(sample.token_versions) == [2] * len(sample.token_ids)
    finally:
        actor.close()


@pytest.mark.slow
def test_broadcast_and_checkpoint_sync_leave_engine_weights_bit_equal(ray_session, tmp_path):
    model = ModelConfig(config=dict(TINY_QWEN3))
    engine = RemoteEngine(Selection(name="torch", options={"max_num_seqs": 4}), model, seed=0,
                          checkpoint_dir=str(tmp_path / "sync"))
    try:
        trainer = load_causal_lm(model, seed=1).state_dict()
        assert weights_digest(trainer.items()) != engine.weights_digest()  # negative control
        engine.update_weights(trainer.items(), version=3, method="checkpoint")
        assert engine.weights_digest() == weights_digest(trainer.items())
        assert sorted(os.listdir(tmp_path / "sync")) == ["weights_v000003.safetensors"]  # no partial file left

        gen = torch.Generator().manual_seed(7)
        moved = {n: t + 0.01 * torch.randn(t.shape, generator=gen) for n, t in trainer.items()}
        tied = [n for n, t in trainer.items() if n != "model.embed_tokens.weight"
                and t.data_ptr() == trainer["model.embed_tokens.weight"].data_ptr()]
        for name in tied:  # the tiny model ties its unembedding: a tied pair moves together
            moved[name] = moved["model.embed_tokens.weight"]
        assert weights_digest(moved.items()) != engine.weights_digest()
        engine.update_weights(moved.items(), version=4, method="broadcast")
        assert engine.weights_digest() == weights_digest(moved.items())
        engine.update_weights(trainer.items(), version=5, method="broadcast")  # the pair is reused
        assert engine.weights_digest() == weights_digest(trainer.items())

        sample = engine.generate([request((1, 2, 3), "r", max_tokens=6, seed=0)])[0][0]
        assert list(sample.token_versions) == [5] * len(sample.token_ids)
        engine.pause()
        engine.resume()
    finally:
        engine.close()


@pytest.mark.slow
def test_a_killed_engine_process_is_reported_by_name_within_seconds(ray_session):
    engine = RemoteEngine(Selection(name="torch"), ModelConfig(config=dict(TINY_QWEN3)), seed=0, name="engine-7")
    os.kill(engine.pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(EngineProcessError, match=rf"engine process 'engine-7' \(pid {engine.pid}\) died"):
        engine.generate([request((1, 2, 3), "r", max_tokens=4, seed=0)])
    assert time.monotonic() - started < 10
