"""Test helpers: a tiny Qwen3 model directory and a real ``skyrl tinker serve`` subprocess."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

from skyrl_core.testing.backend_contract import TINY_QWEN3

TEST_KEY = "tml-skyrl-test-key"


def byte_tokenizer():
    """A real transformers tokenizer: one token per byte, EOS ``<|im_end|>`` (no hub files)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def write_tiny_model(directory: Path, seed: int = 0) -> str:
    """TINY_QWEN3 with untied embeddings (so the unembedding can carry an adapter) and a tokenizer."""
    from skyrl_core.config.schema import ModelConfig
    from skyrl_core.models import load_causal_lm

    model = load_causal_lm(ModelConfig(config={**TINY_QWEN3, "tie_word_embeddings": False}), seed=seed)
    model.save_pretrained(str(directory), safe_serialization=True)
    byte_tokenizer().save_pretrained(str(directory))
    return str(directory)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(model_dir: str, checkpoints: Path, *, extra: tuple[str, ...] = (), env: dict[str, str] | None = None,
          port: int | None = None) -> Iterator[str]:
    """``skyrl tinker serve`` in a subprocess; yields its base URL once /healthz answers."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "skyrl_core", "tinker", "serve", "--model", model_dir, "--model-name", "tiny",
           "--port", str(port), "--checkpoints", str(checkpoints), *extra]
    log = open(checkpoints.parent / f"server-{port}.log", "ab")
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited {proc.returncode}: {(checkpoints.parent / f'server-{port}.log').read_text()[-3000:]}")
            try:
                urllib.request.urlopen(f"{url}/api/v1/healthz", timeout=1)
                break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
