"""The trainer's dynamic sampling (``algorithm.dynamic_sampling``): which groups a step trains on,
how many rollout batches it takes, with which seeds and group ids. The rollout itself is replaced by
a function of the prompt rows (each row says its samples' rewards); everything else is the trainer's."""

from __future__ import annotations

import pytest

from skyrl_core.config.loader import structure_config
from skyrl_core.rollout import Trajectory, request_seed
from skyrl_core.trainer.rl import _collect_rollouts
from skyrl_core.trainer.sampler import PromptSampler


def config(prompts_per_step=2, seed=3, **dynamic_sampling):
    return structure_config({
        "model": {"path": "/nonexistent"},
        "data": {"prompts_per_step": prompts_per_step},
        "trainer": {"seed": seed},
        "algorithm": {"dynamic_sampling": dynamic_sampling},
    })


class FakeRollout:
    """Two samples per prompt row with the row's ``rewards``; records each call's seed and prefix."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], int, str]] = []

    def __call__(self, rows, seed, prefix):
        self.calls.append(([r["id"] for r in rows], seed, prefix))
        return [Trajectory(group_id=f"{prefix}{r['id']}", trajectory_id=f"{prefix}{r['id']}/{k}", prompt_ids=[1],
                           step_rewards=[reward]) for r in rows for k, reward in enumerate(r["rewards"])]


ROWS = [
    {"id": "flat0", "rewards": [1.0, 1.0]},
    {"id": "mixed1", "rewards": [0.0, 1.0]},
    {"id": "flat2", "rewards": [0.0, 0.0]},
    {"id": "flat3", "rewards": [0.5, 0.5]},
    {"id": "mixed4", "rewards": [1.0, 0.0]},
    {"id": "mixed5", "rewards": [0.2, 0.9]},
    {"id": "close6", "rewards": [0.3, 0.3 + 1e-9]},
    {"id": "flat7", "rewards": [1.0, 1.0]},
]


def collect(cfg, rows=ROWS, step=4):
    rollout = FakeRollout()
    sampler = PromptSampler(rows, seed=0, shuffle=False)
    trajectories, samples, metrics = _collect_rollouts(step, cfg, sampler, rollout)
    return rollout, trajectories, samples, metrics, sampler


def groups(samples):
    return list(dict.fromkeys(s.group_id for s in samples))


def test_none_trains_on_every_group_from_one_batch():
    rollout, trajectories, samples, metrics, _ = collect(config())
    assert groups(samples) == ["4:flat0", "4:mixed1"] and metrics == {}
    # the first batch keeps the seed and group prefix a step always had
    assert rollout.calls == [(["flat0", "mixed1"], request_seed(3, "train", 4), "4:")]


def test_drop_keeps_groups_with_signal_from_one_batch():
    rollout, trajectories, samples, metrics, _ = collect(config(mode="drop"))
    assert groups(samples) == ["4:mixed1"] and len(rollout.calls) == 1
    assert metrics == {"dynamic_sampling/kept_frac": 0.5, "dynamic_sampling/batches": 1.0,
                       "dynamic_sampling/groups": 1.0}


def test_resample_rolls_out_more_batches_until_the_step_is_full():
    rollout, trajectories, samples, metrics, sampler = collect(config(mode="resample"))
    # batch 1: flat0, mixed1 -> 1 group; batch 2: flat2, flat3 -> none; batch 3: mixed4, mixed5 -> full
    assert [c[0] for c in rollout.calls] == [["flat0", "mixed1"], ["flat2", "flat3"], ["mixed4", "mixed5"]]
    assert groups(samples) == ["4:mixed1", "4.3:mixed4"]  # the first prompts_per_step groups with signal
    assert [c[2] for c in rollout.calls] == ["4:", "4.2:", "4.3:"]
    seeds = [c[1] for c in rollout.calls]
    assert seeds[0] == request_seed(3, "train", 4) and len(set(seeds)) == 3
    assert len(trajectories) == 12  # every rollout is reported in the step's rollout metrics
    assert metrics["dynamic_sampling/batches"] == 3.0 and metrics["dynamic_sampling/kept_frac"] == pytest.approx(4 / 12)
    assert sampler.state()["position"] == 6  # the extra prompts were consumed


def test_resample_stops_at_max_sample_batches_and_trains_on_what_it_has():
    rollout, _, samples, metrics, _ = collect(config(mode="resample", max_sample_batches=2))
    assert len(rollout.calls) == 2 and groups(samples) == ["4:mixed1"]
    assert metrics["dynamic_sampling/groups"] == 1.0


def test_zero_variance_tolerance():
    rows = [{"id": "close", "rewards": [0.3, 0.3 + 1e-9]}, {"id": "mixed", "rewards": [0.0, 1.0]}]
    _, _, exact, _, _ = collect(config(mode="drop"), rows)
    _, _, tolerant, _, _ = collect(config(mode="drop", zero_variance_tol=1e-6), rows)
    assert groups(exact) == ["4:close", "4:mixed"]
    assert groups(tolerant) == ["4:mixed"]
