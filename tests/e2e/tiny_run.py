"""Tiny end-to-end runs: a tiny Qwen3 (byte tokenizer) learning the ``digits`` task.

``python -m tests.e2e.tiny_run CONFIG [KEY=VALUE ...]`` runs ``skyrl train`` with the test
environments registered; with ``SKYRL_TEST_KILL_AT_CHECKPOINT=N`` the process SIGKILLs itself
right after the checkpoint of step N is complete (a crash, not a clean exit).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import Any, Iterator

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


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Tiny models gain nothing from a second thread; on a busy machine its spin-waits made a
    tiny run 10x slower (155 s instead of 13)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def tiny_arithmetic_rows() -> list[dict[str, Any]]:
    """The four problems ``a * b`` with a, b in {0, 1} (answer 0 three times in four), as
    ``arithmetic`` environment rows."""
    from skyrl_envs.arithmetic import ArithmeticOptions, arithmetic_rows

    rows, _ = arithmetic_rows(4, 0, options=ArithmeticOptions(max_operand=1, operations=("*",)))
    return rows


def sft_tiny_arithmetic(directory: Path, steps: int = 10) -> str:
    """``skyrl sft`` of the tiny Qwen3 on the answers of ``tiny_arithmetic_rows`` (a few steps: it
    learns to answer with a digit, mostly 0, not yet the products); returns the exported directory
    (byte tokenizer included), a ``model.path`` for later runs."""
    from skyrl_core.config.loader import load_config
    from skyrl_core.plugins.manager import new_plugin_manager
    from skyrl_core.trainer.sft import sft

    chats = [{"messages": [*r["prompt"], {"role": "assistant", "content": r["reward_spec"]["ground_truth"]}]}
             for r in tiny_arithmetic_rows()]
    write_jsonl(chats, directory / "sft.jsonl")
    config = {"model": {"config": TINY_QWEN3}, "data": {"train": str(directory / "sft.jsonl")},
              "trainer": {"steps": steps, "lr": 1e-2, "micro_batch_size": 16, "checkpoint_every": 0, "progress": False,
                          "plot": False, "output_dir": str(directory / "sft")},
              "sft": {"batch_size": 16, "max_length": 128}}
    (directory / "sft.yaml").write_text(yaml.safe_dump(config))
    pm = new_plugin_manager()
    return sft(load_config(str(directory / "sft.yaml"), plugin_manager=pm), plugin_manager=pm).hf_dir


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
