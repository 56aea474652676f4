"""``skyrl isoexec verify --engine vllm`` for real against the FSDP trainer, compared on bits; ``--off``
shows the native mismatch. The qwen3 cases run vLLM in its default multiprocess mode (engine core and
worker in their own processes, IsoExec installed there by skyrl's vLLM bootstrap); the other families
run it in the verifying process (``--engine-option multiprocess=false``): the same IsoExec layers and
ops, without two process start-ups (about 20 s each case on 2 cores)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow


def _engine_mode(preset: str) -> tuple[str, ...]:
    return () if preset == "qwen3" else ("--engine-option", "multiprocess=false")


def _verify(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, int, int]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache")}
    env.pop("SKYRL_ISOEXEC", None)
    result = subprocess.run(
        [sys.executable, "-m", "skyrl_core", "isoexec", "verify", "--engine", "vllm", "--batches", "2", *args],
        capture_output=True, text=True, env=env, timeout=900,
    )
    summary = re.search(r"^(\d+) differing tokens of (\d+);", result.stdout, re.MULTILINE)
    assert summary, result.stdout + result.stderr[-3000:]
    return result, int(summary.group(1)), int(summary.group(2))


@pytest.mark.parametrize("preset", ["qwen3", "llama", "qwen3-moe", "qwen3-next"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verify_with_vllm_reports_zero_differing_tokens(tmp_path, preset, dtype):
    result, differing, tokens = _verify(tmp_path, "--preset", preset, "--dtype", dtype, *_engine_mode(preset))
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert differing == 0 and tokens > 0
    hashes = re.search(r"contract hashes: trainer (\w+) engine (\w+)", result.stdout)
    assert hashes and hashes.group(1) == hashes.group(2)
    assert "contract:" not in result.stdout  # no handshake problem, fingerprints included


@pytest.mark.parametrize(("preset", "dtype"), [("qwen3", "float32"), ("llama", "bfloat16"), ("qwen3-moe", "float32"), ("qwen3-next", "bfloat16")])
def test_verify_off_shows_the_native_vllm_mismatch(tmp_path, preset, dtype):
    result, differing, tokens = _verify(tmp_path, "--preset", preset, "--dtype", dtype, "--off", *_engine_mode(preset))
    assert result.returncode == 1 and 0 < differing <= tokens, result.stdout


def test_verify_refuses_a_bad_engine_option_before_building_anything(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "skyrl_core", "isoexec", "verify", "--engine", "vllm", "--preset", "qwen3",
         "--engine-option", "kv_cache_bytes=1"], capture_output=True, text=True, env=env, timeout=300,
    )
    assert result.returncode == 2, result.stdout + result.stderr[-2000:]
    assert "inference_engine:vllm.kv_cache_bytes: unknown key" in result.stderr
    assert "kv_cache_memory_bytes" in result.stderr  # what is allowed
    assert "differing tokens" not in result.stdout  # nothing was generated or scored
