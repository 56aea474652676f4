"""``trainer.mode`` end to end with the torch engine on a tiny model: each mode trains, and the
per-token policy versions of every trained batch obey the mode (sync: the trained policy;
one_step_off: one version behind; fully_async: never more than max_staleness behind, and some
sample spans two versions: its generation was paused and resumed under new weights)."""

from __future__ import annotations

import pytest
import torch

from skyrl_core.config.loader import load_config
from skyrl_core.trainer.metrics import read_metrics
from skyrl_core.trainer.rl import train
from tests.e2e.tiny_run import write_tiny_config
from tests.rollout.envs import TestEnvironments


def _run(tmp_path, pm, monkeypatch, mode: str, *overrides: str):
    """Train 4 steps; return the metrics and the ``token_versions`` of each step's trained batch."""
    from skyrl_fsdp.backend import FSDPBackend

    trained: list[torch.Tensor] = []
    original = getattr(FSDPBackend.forward_backward, "__wrapped__", FSDPBackend.forward_backward)  # (a 2nd run)

    def recording(self, batch, loss_fn):
        trained.append(batch.token_versions.clone())
        return original(self, batch, loss_fn)

    recording.__wrapped__ = original

    monkeypatch.setattr(FSDPBackend, "forward_backward", recording)
    config = write_tiny_config(tmp_path, steps=4, mini_batches=1)
    cfg = load_config(str(config), [f"trainer.mode={mode}", "generation.max_new_tokens=16", "data.eval=null", *overrides],
                      plugin_manager=pm)
    records = read_metrics(train(cfg, plugin_manager=pm).run_dir)
    return [r for r in records if r["step"] > 0], trained


@pytest.fixture
def pm(fresh_plugin_manager):
    fresh_plugin_manager.register_plugin(TestEnvironments(), "test-envs")
    return fresh_plugin_manager


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "one_step_off"])
def test_sync_and_one_step_off_train_on_the_policy_they_promise(tmp_path, pm, monkeypatch, mode):
    records, batches = _run(tmp_path, pm, monkeypatch, mode)
    assert [r["step"] for r in records] == [1, 2, 3, 4] and len(batches) == 4
    for step, versions in enumerate(batches, start=1):
        sampled = versions[versions >= 0]
        lag = 0 if mode == "sync" else min(1, step - 1)  # one_step_off: step 1 has no older policy
        assert sampled.numel() > 0 and set(sampled.tolist()) == {step - 1 - lag}, (step, set(sampled.tolist()))
    assert all(r["loss"] == r["loss"] and r["grad_norm"] > 0 for r in records)
    if mode == "one_step_off":
        assert [r["async/staleness_max"] for r in records] == [0.0, 1.0, 1.0, 1.0]
        assert all("time/trainer_wait" in r and "time/generator_wait" in r for r in records)


@pytest.mark.slow
def test_fully_async_spans_versions_within_the_staleness_bound(tmp_path, pm, monkeypatch):
    import time

    from skyrl_torch.engine import TorchEngine

    # A sample spans two versions only if a weight update lands while it is being generated. The
    # tiny model decodes faster than it trains, so on an idle machine the generator can finish its
    # staleness window before the update and wait: decoding is slowed (10 ms a token step, 64
    # samples of up to 16 tokens a step) so that the generator is still busy when every update comes.
    decode = TorchEngine._decode_step

    def slow_decode(self, *args, **kwargs):
        time.sleep(0.01)
        return decode(self, *args, **kwargs)

    monkeypatch.setattr(TorchEngine, "_decode_step", slow_decode)
    records, batches = _run(tmp_path, pm, monkeypatch, "fully_async",
                            "trainer.fully_async.max_inflight=16", "trainer.fully_async.max_staleness=1")
    assert [r["step"] for r in records] == [1, 2, 3, 4] and len(batches) == 4
    spans = 0
    for step, versions in enumerate(batches, start=1):
        sampled = versions.clone()
        assert (sampled[sampled >= 0] <= step - 1).all()  # never a future policy
        oldest = torch.where(sampled >= 0, sampled, step - 1).min(dim=1).values
        assert int((step - 1 - oldest).max()) <= 1  # the bound, on every trained sample
        per_row = [len(set(row[row >= 0].tolist())) for row in versions]
        spans += sum(n >= 2 for n in per_row)
    assert spans >= 1  # some trajectory was paused, took new weights in place, and continued
    assert max(r["async/versions_per_sample_max"] for r in records) >= 2
    for r in records:
        assert r["async/staleness_max"] <= 1 and r["async/dropped"] >= 0
        assert {"async/staleness_mean", "time/trainer_wait", "time/generator_wait"} <= set(r)


@pytest.mark.slow
def test_fully_async_rollout_logprobs_are_the_trainers_bits_with_isoexec(tmp_path, pm, monkeypatch):
    """With IsoExec on and ``kv_on_update: recompute``, every trained token's rollout logprob equals
    the trainer's logprob at that token's policy version, bit for bit, samples spanning two versions
    included (the trainer's weights of each version are kept and loaded back to score its tokens).
    Negative controls: IsoExec off, some token differs; ``keep`` (paused samples keep the old
    weights' keys/values), some token sampled after an update differs while every other token
    (those before it, samples of one version) still matches."""
    import os
    import time

    from skyrl_fsdp.backend import FSDPBackend
    from skyrl_isoexec import state
    from skyrl_torch.engine import TorchEngine
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    # per run and step, for each trained token: (bit-equal?, sampled after its sample's first version?)
    tokens: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    original = FSDPBackend.forward_backward

    def load(model, version):  # (a copy: set_model_state_dict fills the dict it is given with the model's tensors)
        set_model_state_dict(model, dict(weights[version]), options=StateDictOptions(full_state_dict=True))

    def comparing(self, batch, loss_fn):
        trained = len(weights)  # step k trains version k - 1 (one optimizer step a training step)
        weights.append({k: t.clone() for k, t in self.export_weights()})  # (a copy: they may be the live tensors)
        model = self._local.model  # (world_size 1: the trainer is in this process)
        versions = batch.token_versions
        scored = (batch.loss_mask > 0) & (versions >= 0)
        first = torch.where(scored, versions, trained).min(dim=1, keepdim=True).values
        mine = torch.zeros_like(batch.rollout_logprobs)
        for v in sorted(set(versions[scored].tolist())):
            load(model, v)
            mine = torch.where(scored & (versions == v), self.forward(batch), mine)
        load(model, trained)
        equal = mine.view(torch.int32) == batch.rollout_logprobs.view(torch.int32)
        tokens[name].append((equal[scored], (versions > first)[scored]))
        return original(self, batch, loss_fn)

    monkeypatch.setattr(FSDPBackend, "forward_backward", comparing)
    # Samples span two versions only if updates land mid-generation: decoding is slowed (10 ms a
    # token step) so that the generator is still busy when each update comes. Without it, once the
    # tiny model's decode steps ran on one thread (skyrl-torch's one_thread_below_macs) instead of
    # two beside the trainer's, generation finished first and two runs in a row had no span.
    decode = TorchEngine._decode_step

    def slow_decode(self, *args, **kwargs):
        time.sleep(0.01)
        return decode(self, *args, **kwargs)

    monkeypatch.setattr(TorchEngine, "_decode_step", slow_decode)
    monkeypatch.delenv("SKYRL_ISOEXEC", raising=False)
    config = write_tiny_config(tmp_path, steps=4, mini_batches=1)
    saved = state.configure(None)
    try:
        for name, enabled, kv in (("isoexec", "true", "recompute"), ("stock", "false", "recompute"),
                                  ("keep", "true", "keep")):
            tokens[name], weights = [], []
            # max_inflight 8: one worker, so each update lands mid-generation and samples spanning
            # two versions are trained (2 runs of 3 without it had none)
            cfg = load_config(str(config), [f"isoexec.enabled={enabled}", "trainer.mode=fully_async", "data.eval=null",
                                            "generation.max_new_tokens=16", "trainer.fully_async.max_inflight=8",
                                            f"trainer.fully_async.kv_on_update={kv}",
                                            f"trainer.output_dir={tmp_path / name}"], plugin_manager=pm)
            train(cfg, plugin_manager=pm)
    finally:
        state.configure(saved)
        os.environ.pop("SKYRL_ISOEXEC", None)
    equal, later = {}, {}
    for name, steps in tokens.items():
        assert len(steps) == 4, name
        equal[name], later[name] = (torch.cat(parts) for parts in zip(*steps))
        print(name, "tokens", equal[name].numel(), "after an update", int(later[name].sum()), "differing", int((~equal[name]).sum()))
    for name in ("isoexec", "keep"):  # (the stock run's negative control needs none)
        assert int(later[name].sum()) > 0, f"{name}: no trained sample spans two versions"
    assert bool(equal["isoexec"].all())  # every trained token, of every version
    assert not bool(equal["stock"].all())
    keep = equal["keep"]
    assert bool(keep[~later["keep"]].all()) and not bool(keep[later["keep"]].all())


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["one_step_off", "fully_async"])
def test_async_resume_loses_no_completed_step_and_keeps_versions_monotone(tmp_path, pm, monkeypatch, mode):
    """A run stopped after its step-2 checkpoint and resumed to step 4: steps 1-4 each logged once,
    and every batch after the resume was sampled by versions >= 2 (the restored policy) and never
    by a version newer than the one it trains."""
    _, first = _run(tmp_path, pm, monkeypatch, mode, "trainer.steps=2")
    records, resumed = _run(tmp_path, pm, monkeypatch, mode, f"trainer.resume={tmp_path / 'run'}")
    assert [r["step"] for r in records] == [1, 2, 3, 4] and len(first) == 2 and len(resumed) == 2
    for step, versions in zip((3, 4), resumed):
        sampled = versions[versions >= 0]
        assert sampled.numel() and int(sampled.min()) >= 2 and int(sampled.max()) <= step - 1
