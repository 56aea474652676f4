"""State files: nested training state round-trips through safetensors + JSON, and reading runs no code."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from skyrl_core.state_file import SKELETON_KEY, StateFileError, load_state, save_state


def test_nested_state_round_trips_with_its_types(tmp_path) -> None:
    weights = torch.randn(4, 3)
    state = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": weights, "exp_avg_sq": weights[1:]}},  # a view
        "param_groups": [{"lr": 1e-5, "betas": (0.9, 0.999), "params": [0], "fused": None, "maximize": False}],
        "numpy": ("MT19937", np.arange(5, dtype=np.uint32) * 4_000_000_000 // 5, 624, 0, 0.0),
        "python": (3, tuple(range(625)), None),
        "extremes": [math.inf, -0.0, 2**70],
    }
    save_state(str(tmp_path / "s.safetensors"), state)
    back = load_state(str(tmp_path / "s.safetensors"))
    assert back["state"][0]["exp_avg"].view(torch.int32).equal(weights.view(torch.int32))
    assert back["state"][0]["exp_avg_sq"].view(torch.int32).equal(weights[1:].view(torch.int32))
    assert back["param_groups"] == state["param_groups"] and isinstance(back["param_groups"][0]["betas"], tuple)
    assert back["numpy"][1].dtype == np.uint32 and back["numpy"][1].tolist() == state["numpy"][1].tolist()
    assert back["python"] == state["python"]
    assert back["extremes"] == [math.inf, -0.0, 2**70] and math.copysign(1, back["extremes"][1]) == -1
    assert list(back["state"]) == [0]  # int keys stay ints (optimizer state is keyed by parameter index)


def test_a_value_that_cannot_come_back_is_refused_when_saving(tmp_path) -> None:
    with pytest.raises(TypeError, match=r"state\['opt'\]: cannot store a object"):
        save_state(str(tmp_path / "s.safetensors"), {"opt": object()})


def test_files_that_are_not_state_files_are_refused(tmp_path) -> None:
    pickled = tmp_path / "pickled.safetensors"
    torch.save({"a": 1}, pickled)
    with pytest.raises(StateFileError, match="not a safetensors state file"):
        load_state(str(pickled))
    plain = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(1)}, str(plain))
    with pytest.raises(StateFileError, match="without skyrl state"):
        load_state(str(plain))
    forged = tmp_path / "forged.safetensors"
    save_file({"x": torch.zeros(1)}, str(forged), metadata={SKELETON_KEY: json.dumps({"__skyrl__": "exec", "cmd": "id"})})
    with pytest.raises(StateFileError, match="unknown tag 'exec'"):
        load_state(str(forged))
    with pytest.raises(StateFileError, match="missing"):
        load_state(str(tmp_path / "nothing"))
