"""Multi-turn rollouts through the real skyrl-torch engine with a tiny model and a tool environment."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from skyrl_core.config.schema import ModelConfig, Selection
from skyrl_core.models import load_tokenizer
from skyrl_core.plugins.manager import new_plugin_manager
from skyrl_core.rollout import (
    ChatCodec,
    EnvironmentFactory,
    RolloutError,
    RolloutGenerator,
    Sampling,
    build_training_batch,
    token_rewards,
    training_samples,
)
from skyrl_core.trainer.runtime import build_selected
from tests.rollout.chatml import save_chatml_tokenizer
from tests.rollout.envs import TINY_QWEN3, TestEnvironments, prompt_rows


class RecordingEngine:
    """Passes calls to the real engine and keeps every request and what it returned."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.calls: list[dict[str, tuple[Any, list[Any]]]] = []

    def generate(self, requests):
        outputs = self.engine.generate(requests)
        self.calls.append({r.request_id: (r, out) for r, out in zip(requests, outputs)})
        return outputs


@pytest.fixture(scope="module")
def plugin_manager():
    pm = new_plugin_manager()
    pm.register_plugin(TestEnvironments(), "test-envs")
    return pm


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> ModelConfig:
    return ModelConfig(config=TINY_QWEN3, tokenizer=save_chatml_tokenizer(tmp_path_factory.mktemp("chatml")))


@pytest.fixture(scope="module")
def engine(plugin_manager, model):
    engine = build_selected(plugin_manager, "inference_engine", Selection(name="torch"), model, seed=0)
    yield engine
    engine.close()


def _generator(plugin_manager, engine, model, env: str, **kwargs) -> RolloutGenerator:
    codec = ChatCodec(load_tokenizer(model))
    return RolloutGenerator(engine, codec, EnvironmentFactory(plugin_manager, env), **kwargs)


SAMPLING = Sampling(n=2, max_new_tokens=12, temperature=1.0)


def test_multi_turn_carries_engine_tokens_and_masks_environment_tokens(plugin_manager, engine, model) -> None:
    recorder = RecordingEngine(engine)
    gen = _generator(plugin_manager, recorder, model, "counter_tool", max_turns=3)
    trajectories = gen.generate(prompt_rows(2, "counter_tool"), SAMPLING, seed=7)
    codec, tokenizer = gen.codec, gen.codec.tokenizer
    assert [t.trajectory_id for t in trajectories] == ["0/0", "0/1", "1/0", "1/1"]
    assert len(recorder.calls) == 3  # one engine call per turn, every episode batched in it
    retokenised_differs = 0
    for traj in trajectories:
        g, s = map(int, traj.trajectory_id.split("/"))
        # turn 1: one request per prompt with n samples; later turns: one request per episode
        expected = [recorder.calls[0][str(g)][1][s]] + [recorder.calls[t][f"{g}/{s}"][1][0] for t in (1, 2)]
        assert [seg.trained for seg in traj.segments] == [True, False, True, False, True]
        model_segments = [seg for seg in traj.segments if seg.trained]
        context = list(traj.prompt_ids)
        for turn, (seg, sample) in enumerate(zip(model_segments, expected)):
            # exactly the engine's ids and logprobs: no decode/encode round trip
            assert seg.token_ids == sample.token_ids and seg.logprobs == sample.logprobs
            request = recorder.calls[turn][str(g) if turn == 0 else f"{g}/{s}"][0]
            assert list(request.prompt_token_ids) == context  # each turn continues the exact context
            context += list(seg.token_ids)
            if turn < 2:
                env_seg = traj.segments[2 * turn + 1]
                observation = traj.messages[traj.messages.index({"role": "assistant", "content": sample.text}) + 1]
                assert list(env_seg.token_ids) == codec.close_turn(seg.token_ids) + codec.render_messages([observation])
                assert f"Observation {turn + 1}:" in observation["content"]
                context += list(env_seg.token_ids)
            retokenised_differs += tokenizer.encode(sample.text, add_special_tokens=False) != list(sample.token_ids)
        sample_row = traj.as_sample()
        mask = torch.tensor(sample_row.loss_mask)
        trained = torch.cat([torch.full((len(seg.token_ids),), float(seg.trained)) for seg in traj.segments])
        assert torch.equal(mask, trained)
        assert list(sample_row.response_ids) == traj.response_ids == context[len(traj.prompt_ids):]
        assert all(lp == 0.0 for lp, m in zip(sample_row.logprobs, sample_row.loss_mask) if m == 0)
        assert traj.num_turns == 3 and traj.stop_reason in ("stop", "length")
    # negative control: re-tokenising the model's text would have changed the ids
    assert retokenised_differs > 0


def test_stepwise_samples_are_one_per_turn(plugin_manager, engine, model) -> None:
    gen = _generator(plugin_manager, engine, model, "counter_tool", max_turns=3)
    trajectories = gen.generate(prompt_rows(1, "counter_tool"), SAMPLING, seed=3)
    samples = training_samples(trajectories, stepwise=True)
    assert len(samples) == 6
    for traj in trajectories:
        steps = [s for s in samples if s.trajectory_id == traj.trajectory_id]
        model_segments = [seg for seg in traj.segments if seg.trained]
        assert [s.response_ids for s in steps] == [seg.token_ids for seg in model_segments]
        assert [s.is_last_step for s in steps] == [False, False, True]
        full = traj.prompt_ids + traj.response_ids
        for s in steps:
            assert list(s.prompt_ids + s.response_ids) == full[: len(s.prompt_ids) + len(s.response_ids)]
            assert set(s.loss_mask) == {1.0} and s.reward == traj.reward
    whole = training_samples(trajectories, stepwise=False)
    assert len(whole) == 2 and all(s.is_last_step for s in whole)


def test_rollouts_are_determined_by_the_seed(plugin_manager, engine, model) -> None:
    gen = _generator(plugin_manager, engine, model, "counter_tool", max_turns=2)
    rows = prompt_rows(2, "counter_tool")
    first = [t.response_ids for t in gen.generate(rows, SAMPLING, seed=11)]
    again = [t.response_ids for t in gen.generate(rows, SAMPLING, seed=11)]
    other = [t.response_ids for t in gen.generate(rows, SAMPLING, seed=12)]
    assert first == again
    assert first != other


def test_response_budget_ends_episodes(plugin_manager, engine, model) -> None:
    gen = _generator(plugin_manager, engine, model, "counter_tool", max_turns=3, max_response_tokens=20)
    for traj in gen.generate(prompt_rows(2, "counter_tool"), SAMPLING, seed=5):
        assert len(traj.response_ids) <= 20
        assert traj.num_turns < 3 and traj.stop_reason == "max_response_tokens"


def test_single_turn_rewards_and_training_batch(plugin_manager, engine, model) -> None:
    gen = _generator(plugin_manager, engine, model, "digits")
    trajectories = gen.generate(prompt_rows(3, "digits"), Sampling(n=4, max_new_tokens=10), seed=1)
    samples = training_samples(trajectories, stepwise=False)
    for traj in trajectories:
        text = traj.messages[-1]["content"]
        assert traj.reward == sum(c.isdigit() for c in text) / max(1, len(text))
    batch = build_training_batch(samples, gen.codec.pad_token_id)
    P, R = batch.prompt_len, batch.response_len
    assert R == max(len(s.response_ids) for s in samples)
    for row, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        assert batch.input_ids[row, P - p:P].tolist() == list(s.prompt_ids)  # left-padded prompt
        assert batch.attention_mask[row, :P - p].sum() == 0
        assert batch.input_ids[row, P:P + r].tolist() == list(s.response_ids)  # right-padded response
        assert batch.attention_mask[row, P + r:].sum() == 0 and batch.loss_mask[row, r:].sum() == 0
        assert batch.rollout_logprobs[row, :r].tolist() == pytest.approx(list(s.logprobs), abs=0, rel=1e-7)
    assert list(batch.group_ids) == [s.group_id for s in samples] and batch.group_ids[0] == batch.group_ids[3] == "0"
    rewards = token_rewards(samples, batch.loss_mask)
    last = batch.loss_mask.cumsum(-1).argmax(-1)
    assert torch.equal(rewards.sum(-1), torch.tensor([s.reward for s in samples], dtype=torch.float32))
    assert all(rewards[row, last[row]] == s.reward for row, s in enumerate(samples))


def test_prompt_longer_than_the_cap_is_refused(plugin_manager, engine, model) -> None:
    gen = _generator(plugin_manager, engine, model, "digits", max_prompt_tokens=10)
    with pytest.raises(RolloutError, match="max_prompt_tokens=10"):
        gen.generate(prompt_rows(1, "digits"), SAMPLING, seed=0)
