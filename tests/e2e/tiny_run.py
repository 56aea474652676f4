"""Tiny end-to-end runs: a tiny Qwen3 (byte tokenizer) learning the ``digits`` task.

``python -m tests.e2e.tiny_run CONFIG [KEY=VALUE ...]`` runs ``skyrl train`` with the test
environments registered; with ``SKYRL_TEST_KILL_AT_CHECKPOINT=N`` the process SIGKILLs itself
right after the checkpoint of step N is complete (a crash, not a clean exit).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import yaml

from skyrl_core.data import write_jsonl
from skyrl_core.plugins import hookimpl
from tests.rollout.envs import TINY_QWEN3, TestEnvironments, prompt_rows


def write_tiny_config(directory: Path, env: str = "digits", **trainer: Any) -> Path:
    """Data and a config for a fast fp32 GRPO run (``digits``: a task the tiny model learns);
    returns the config path."""
    write_jsonl(prompt_rows(64, env), directory / "train.jsonl")
    write_jsonl(prompt_rows(16, env), directory / "eval.jsonl")
    config = {
        "model": {"config": TINY_QWEN3},
        "environment": env,
        "data": {"train": str(directory / "train.jsonl"), "eval": str(directory / "eval.jsonl"), "prompts_per_step": 8},
        "generation": {"max_new_tokens": 8, "n_samples": 8, "eval_temperature": 1.0},
        "algorithm": {"policy_loss": "ppo", "advantage": "grpo"},
        "trainer": {"lr": 1e-2, "micro_batch_size": 32, "mini_batches": 2, "progress": False,
                    "output_dir": str(directory / "run"), **trainer},
    }
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


class KillAtCheckpoint:
    def __init__(self, step: int) -> None:
        self.step = step

    @hookimpl
    def skyrl_on_checkpoint(self, step: int, path: str) -> None:
        if step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> None:
    import torch

    from skyrl_core.cli.main import cli
    from skyrl_core.plugins.manager import get_plugin_manager

    torch.set_num_threads(1)
    pm = get_plugin_manager()
    pm.register_plugin(TestEnvironments(), "test-envs")
    if os.environ.get("SKYRL_TEST_KILL_AT_CHECKPOINT"):
        pm.register_plugin(KillAtCheckpoint(int(os.environ["SKYRL_TEST_KILL_AT_CHECKPOINT"])), "kill-at-checkpoint")
    cli.main(["train", *argv], prog_name="skyrl", standalone_mode=True)


if __name__ == "__main__":
    main(sys.argv[1:])
