"""``skyrl isoexec verify --engine vllm`` for real against the FSDP trainer, compared on bits; ``--off``
shows the native mismatch. Every family in fp32 and bf16 gives 0 differing tokens. Qwen3 in fp32 runs vLLM
in its default multiprocess mode (engine core and worker in their own processes, IsoExec installed
there by skyrl's vLLM bootstrap); the other cases run it in the verifying process (``--engine-option
multiprocess=false``): the same IsoExec layers and ops, without two process start-ups per case. The
cases of one mode share one CLI process (repeated ``--preset`` / ``--dtype``: one start-up and import
for all, each case reported on its own prefixed lines), which also checks that several in-process vLLM
engines built one after another in one process each give the trainer's bits. The ``--off`` controls
(one dtype per family, ``--preset NAME:DTYPE``) share one in-process run."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

IN_PROCESS = ("--engine-option", "multiprocess=false")
DTYPES = ("float32", "bfloat16")


def _verify(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict[str, tuple[int, int]], tuple[int, int]]:
    """The CLI's result, each case's (differing, tokens) by its ``PRESET DTYPE`` label, and the
    total line's (differing, tokens)."""
    # The session's isolated VLLM_CACHE_ROOT is inherited: a fresh one per run made every vLLM start
    # inspect the model class in a subprocess again (~8 s).
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("SKYRL_ISOEXEC", None)
    result = subprocess.run(
        [sys.executable, "-m", "skyrl_core", "isoexec", "verify", "--engine", "vllm", "--batches", "2", *args],
        capture_output=True, text=True, env=env, timeout=900,
    )
    total = re.search(r"^(\d+) differing tokens of (\d+);", result.stdout, re.MULTILINE)
    assert total, result.stdout + result.stderr[-3000:]
    cases = {m[0]: (int(m[1]), int(m[2]))
             for m in re.findall(r"^([\w-]+ \w+): (\d+) differing tokens of (\d+);", result.stdout, re.MULTILINE)}
    return result, cases, (int(total.group(1)), int(total.group(2)))


def _hashes(output: str) -> dict[str, tuple[str, str]]:
    """Each case's (trainer, engine) contract hashes by label; a lone case's lines have no label ("")."""
    return {m[0].removesuffix(": "): (m[1], m[2])
            for m in re.findall(r"^((?:[\w-]+ \w+: )?)isoexec on; contract hashes: trainer (\w+) engine (\w+)$", output, re.M)}


@pytest.mark.parametrize(
    ("presets", "mode"),
    # Multiprocess: one case proves IsoExec is installed in vLLM's engine-core and worker processes
    # (each multiprocess engine start is ~2 process start-ups); Qwen3's other dtype runs in-process.
    [(("qwen3:float32",), ()), (("qwen3:bfloat16", "llama", "qwen3-moe", "qwen3-next"), IN_PROCESS)],
    ids=["multiprocess", "in-process"],
)
def test_verify_with_vllm_reports_zero_differing_tokens(tmp_path, presets, mode):
    preset_args = [a for p in presets for a in ("--preset", p)]
    dtype_args = [a for d in DTYPES for a in ("--dtype", d)] if any(":" not in p for p in presets) else []
    result, cases, total = _verify(tmp_path, *preset_args, *dtype_args, *mode)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    labels = [p.replace(":", " ") if ":" in p else f"{p} {d}" for p in presets for d in (DTYPES[:1] if ":" in p else DTYPES)]
    hashes = _hashes(result.stdout)
    if len(labels) == 1:  # a lone case is reported without a label: its lines are the total's
        assert cases == {} and list(hashes) == [""], result.stdout
        cases, hashes = {labels[0]: total}, {labels[0]: hashes[""]}
    assert list(cases) == labels, result.stdout  # every case ran and reported, in order
    assert all(differing == 0 < tokens for differing, tokens in cases.values()), cases
    assert total == (0, sum(tokens for _, tokens in cases.values()))
    assert list(hashes) == labels and all(trainer == engine for trainer, engine in hashes.values()), result.stdout
    assert "contract:" not in result.stdout  # no handshake problem, fingerprints included


# The negative controls: each family with IsoExec off, in one dtype each (``--preset NAME:DTYPE``),
# all in one in-process CLI run (stock vLLM's numerics do not depend on where its worker runs; the
# multiprocess mode's IsoExec install is proven by the multiprocess case above giving 0).
OFF_CASES = ("qwen3:float32", "llama:bfloat16", "qwen3-next:bfloat16", "qwen3-moe:float32")


def test_verify_off_shows_the_native_vllm_mismatch(tmp_path):
    result, cases, (differing, tokens) = _verify(
        tmp_path, *(a for case in OFF_CASES for a in ("--preset", case)), "--off", *IN_PROCESS)
    assert result.returncode == 1 and 0 < differing <= tokens, result.stdout
    assert list(cases) == [case.replace(":", " ") for case in OFF_CASES], result.stdout
    assert all(0 < d <= t for d, t in cases.values()), result.stdout  # every family differs natively
    assert (differing, tokens) == tuple(map(sum, zip(*cases.values())))


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
