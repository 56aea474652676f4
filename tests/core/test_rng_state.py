"""``skyrl_core.rng_state``: a captured state, through a state file, makes every generator draw
again what it drew after the capture; older forms of the state still restore."""

from __future__ import annotations

import random

import numpy as np
import torch

from skyrl_core.rng_state import capture_rng_state, restore_rng_state
from skyrl_core.state_file import load_state, save_state


def _draws() -> tuple[float, float, list[int]]:
    return random.random(), float(np.random.rand()), torch.randint(0, 1 << 30, (4,)).tolist()


def test_restored_generators_repeat_their_draws_through_a_state_file(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    path = str(tmp_path / "rng.safetensors")
    save_state(path, capture_rng_state())
    first = _draws()
    assert _draws() != first  # negative control: the generators move on
    restore_rng_state(load_state(path))
    assert _draws() == first


def test_the_numpy_keys_as_a_torch_tensor_and_missing_generators_are_accepted():
    torch.manual_seed(5)
    state = capture_rng_state()
    kind, keys, pos, has_gauss, cached = state["numpy"]
    older = {"torch": state["torch"],  # a checkpoint that kept only torch's and numpy's (as an int64 tensor)
             "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached)}
    expected = float(np.random.rand()), torch.rand(1).item()
    random.seed(7)
    python_next = random.random()
    random.seed(7)
    restore_rng_state(older)
    assert (float(np.random.rand()), torch.rand(1).item()) == expected
    assert random.random() == python_next  # python's generator was not in the state: left alone
