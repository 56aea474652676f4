"""For tests and benchmarks: a model directory built from a config (with a byte-level tokenizer), and
``skyrl tinker serve`` in a child process, waited for until it answers."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

from skyrl_core.ports import on_a_free_port


def byte_tokenizer():
    """A real transformers tokenizer, one token per byte (ids 0..255), EOS ``<|im_end|>``; no files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def write_model_dir(directory: Path, config: dict, *, seed: int = 0) -> str:
    """A Hugging Face directory of a model built from ``config`` (weights from ``seed``) plus
    ``byte_tokenizer()``: what ``skyrl tinker serve --model`` loads. Returns its path."""
    from skyrl_core.config.schema import ModelConfig
    from skyrl_core.models import load_causal_lm

    model = load_causal_lm(ModelConfig(config=dict(config)), seed=seed)
    model.save_pretrained(str(directory), safe_serialization=True)
    byte_tokenizer().save_pretrained(str(directory))
    return str(directory)


@contextlib.contextmanager
def serve_subprocess(
    model_dir: str, checkpoints: Path, *, model_name: str = "tiny", extra: tuple[str, ...] = (),
    env: dict[str, str] | None = None, port: int | None = None, timeout: float = 180.0,
) -> Iterator[tuple[str, subprocess.Popen]]:
    """Yields ``(base URL, process)`` once ``/api/v1/healthz`` answers; the server's output goes to
    ``checkpoints/../server-PORT.log``. Without ``port``, on a free one (another if it was taken
    before the server bound it). The process is stopped (SIGTERM, then SIGKILL) on exit."""

    def start_on(port: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "skyrl_core", "tinker", "serve", "--model", model_dir, "--model-name", model_name,
               "--port", str(port), "--checkpoints", str(checkpoints), *extra]
        log_path = Path(checkpoints).parent / f"server-{port}.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=log, env={**os.environ, **(env or {})})
        try:
            deadline = time.time() + timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited with {proc.returncode}: {log_path.read_text()[-3000:]}")
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/healthz", timeout=1)
                    return proc
                except OSError:
                    if time.time() > deadline:
                        raise
                    time.sleep(0.2)
        except BaseException:
            stop(proc)
            raise

    if port is None:
        proc = on_a_free_port(start_on)
        port = int(proc.args[proc.args.index("--port") + 1])
    else:
        proc = start_on(port)
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        stop(proc)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 30 s."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
