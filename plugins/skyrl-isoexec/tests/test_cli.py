"""``skyrl isoexec ...`` through the real CLI entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def _skyrl(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    full_env.pop("SKYRL_ISOEXEC", None)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "skyrl_core", "isoexec", *args], capture_output=True, text=True, env=full_env, timeout=900
    )


@pytest.mark.slow
def test_verify_reports_zero_and_off_shows_the_native_mismatch():
    on = _skyrl("verify", "--preset", "llama", "--batches", "1", "--seed", "3")
    assert on.returncode == 0, on.stdout + on.stderr
    assert "0 differing tokens of" in on.stdout
    off = _skyrl("verify", "--preset", "llama", "--batches", "1", "--seed", "3", "--off")
    assert off.returncode == 1, off.stdout + off.stderr
    differing = int(off.stdout.strip().splitlines()[-1].split()[0])
    assert differing > 0


@pytest.mark.slow
def test_verify_needs_exactly_one_model_source():
    result = _skyrl("verify")
    assert result.returncode == 2 and "exactly one of --preset and --model" in result.stderr
    result = _skyrl("verify", "--preset", "gpt2")
    assert result.returncode == 2 and "qwen3-next" in result.stderr  # the allowed choices
    result = _skyrl("verify", "--preset", "qwen3", "--engine", "nope")
    assert result.returncode == 2 and "'nope' is not a registered inference engine" in result.stderr


@pytest.mark.slow
def test_contract_show_prints_json_and_hashes(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("model:\n  config: {model_type: qwen3, vocab_size: 512, hidden_size: 64}\nisoexec:\n  enabled: true\n")
    result = _skyrl("contract", "show", str(config))
    assert result.returncode == 0, result.stderr
    text = result.stdout
    contracts = json.loads(text[: text.index("trainer hash:")])
    assert contracts["trainer"]["identity"]["ops"]["attention"]["impl"] == "isoexec.attention"
    assert contracts["trainer"]["hash"] == contracts["engine"]["hash"]
    assert f"engine hash: {contracts['engine']['hash']}" in text
    config.write_text("model:\n  config: {model_type: qwen3}\n")
    off = _skyrl("contract", "show", str(config))
    assert off.returncode == 0 and "isoexec is off for this config" in off.stdout


@pytest.mark.slow
def test_trace_and_compare_name_the_first_divergent_op(tmp_path):
    from skyrl_isoexec.digest import trace

    paths = {}
    for mode in ("full", "decode"):
        for off in (False, True):
            path = tmp_path / f"{mode}-{off}.json"
            path.write_text(json.dumps(trace(preset="qwen3", dtype="float32", seed=0, tokens=6, mode=mode, off=off)))
            paths[mode, off] = str(path)
    cli_trace = tmp_path / "cli.json"
    result = _skyrl("trace", "--preset", "qwen3", "--mode", "decode", "--tokens", "6", "--out", str(cli_trace))
    assert result.returncode == 0, result.stderr
    assert json.loads(cli_trace.read_text())["digest"] == json.loads(open(paths["decode", False]).read())["digest"]
    same = _skyrl("compare", paths["full", False], str(cli_trace))
    assert same.returncode == 0 and "no divergence" in same.stdout
    differ = _skyrl("compare", paths["full", True], paths["decode", True])
    assert differ.returncode == 1
    assert "first divergence: op linear in module model.layers.0.self_attn.q_proj" in differ.stdout
