"""Every generated token carries the policy version that sampled it, from the engine's sample
through ``Trajectory`` to the training batch (-1 on environment tokens and padding)."""

from __future__ import annotations

import pytest
import torch

from skyrl_core.rollout import Trajectory, build_training_batch, training_samples
from skyrl_core.rollout.trajectory import Segment


def _episode() -> Trajectory:
    t = Trajectory(group_id="g", trajectory_id="g/0", prompt_ids=[1, 2])
    t.segments += [
        Segment(token_ids=[5, 6, 7], logprobs=[-0.1] * 3, trained=True, versions=[3, 3, 4]),
        Segment(token_ids=[8, 9], logprobs=[0.0] * 2, trained=False),
        Segment(token_ids=[10], logprobs=[-0.2], trained=True, versions=[5]),
    ]
    t.step_rewards = [1.0]
    return t


def test_versions_reach_the_training_batch_whole_and_stepwise():
    t = _episode()
    assert t.token_versions == [3, 3, 4, -1, -1, 5] and t.versions == {3, 4, 5}
    whole = build_training_batch(training_samples([t], stepwise=False), pad_token_id=0)
    assert whole.token_versions.tolist() == [[3, 3, 4, -1, -1, 5]]
    steps = build_training_batch(training_samples([t], stepwise=True), pad_token_id=0)
    assert steps.token_versions.tolist() == [[3, 3, 4], [5, -1, -1]]  # second row: one token + padding
    assert steps.select([1]).token_versions.dtype == torch.long


def test_a_segment_with_the_wrong_number_of_versions_is_refused():
    with pytest.raises(ValueError, match="versions"):
        Segment(token_ids=[1, 2], logprobs=[0.0, 0.0], trained=True, versions=[0])
