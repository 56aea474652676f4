"""A run loads its policy several times (trainer, engine, reference) and shows transformers'
"Loading weights" bar once."""

from __future__ import annotations

import re

from transformers.utils import logging as hf_logging

from skyrl_core.config.schema import ModelConfig
from skyrl_core.models import load_causal_lm
from skyrl_core.testing.backend_contract import TINY_QWEN3


def test_the_loading_bar_shows_once_per_model_directory(tmp_path, capfd):
    load_causal_lm(ModelConfig(config=dict(TINY_QWEN3))).save_pretrained(tmp_path / "m")
    capfd.readouterr()
    assert hf_logging.is_progress_bar_enabled()
    model = ModelConfig(path=str(tmp_path / "m"))
    for _ in range(3):
        load_causal_lm(model)
    assert len(re.findall(r"Loading weights:\s+0%", capfd.readouterr().err)) == 1  # bars started
    assert hf_logging.is_progress_bar_enabled()  # turned back on for everything else
