"""Test helpers: a tiny Qwen3 model directory and a real ``skyrl tinker serve`` subprocess."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from skyrl_core.testing.backend_contract import TINY_QWEN3
from skyrl_core.ports import free_port  # noqa: F401 - used by tests
from skyrl_tinker.launch import byte_tokenizer, serve_subprocess, write_model_dir  # noqa: F401 - used by tests

TEST_KEY = "tml-skyrl-test-key"


def write_tiny_model(directory: Path, seed: int = 0) -> str:
    """TINY_QWEN3 with untied embeddings (so the unembedding can carry an adapter) and a tokenizer."""
    return write_model_dir(directory, {**TINY_QWEN3, "tie_word_embeddings": False}, seed=seed)


def write_tied_tiny_model(directory: Path, seed: int = 0) -> str:
    """TINY_QWEN3 as it is: lm_head tied to embed_tokens, as in SmolLM2, Llama 3.2 1B or Qwen3 0.6B."""
    return write_model_dir(directory, TINY_QWEN3, seed=seed)


@contextlib.contextmanager
def serve(model_dir: str, checkpoints: Path, *, extra: tuple[str, ...] = (), env: dict[str, str] | None = None,
          port: int | None = None, kill: bool = False) -> Iterator[str]:
    """``skyrl tinker serve`` of the tiny model (one intra-op thread) in a subprocess; yields its URL.
    ``kill``: end it with SIGKILL (a crash: queued work never runs) instead of a clean stop."""
    with serve_subprocess(model_dir, checkpoints, extra=extra, env={"OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **(env or {})}, port=port) as (url, proc):
        yield url
        if kill:
            proc.kill()
            proc.wait()
