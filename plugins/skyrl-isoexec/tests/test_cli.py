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
    # One case: its lines carry no "PRESET DTYPE: " prefix and no total line follows.
    assert on.stdout.startswith("isoexec on; contract hashes:"), on.stdout
    assert "llama float32:" not in on.stdout and "(cases " not in on.stdout
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


def test_verify_cases_take_a_dtype_per_preset():
    """``--preset NAME:DTYPE`` is one case in that dtype; ``--dtype`` is for the presets without one."""
    from skyrl_isoexec.cli import _verify_cases

    cases = _verify_cases((("qwen3", "float32"), ("llama", None), ("qwen3-moe", "bfloat16")), None, ("bfloat16", "float32"))
    assert [(label, source, dtype) for label, source, dtype in cases] == [
        ("qwen3 float32", {"preset": "qwen3"}, "float32"),
        ("llama bfloat16", {"preset": "llama"}, "bfloat16"), ("llama float32", {"preset": "llama"}, "float32"),
        ("qwen3-moe bfloat16", {"preset": "qwen3-moe"}, "bfloat16"),
    ]
    assert [label for label, _, _ in _verify_cases((("llama", None),), None, ())] == ["llama float32"]  # the default


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--preset", "qwen3:float16"], "'qwen3:float16': dtype 'float16' is not one of float32, bfloat16"),
        (["--preset", "gpt2:float32"], "'gpt2' is not a preset; choose from llama, qwen3, qwen3-moe, qwen3-next"),
        (["--preset", "qwen3:float32", "--preset", "qwen3"], "the case qwen3 float32 given more than once"),
        (["--preset", "qwen3:float32", "--preset", "qwen3:float32"], "qwen3:float32 given more than once"),
        # Accepted, --dtype would do nothing: refused.
        (["--preset", "qwen3:float32", "--preset", "llama:bfloat16", "--dtype", "float32"],
         "float32 is for the presets given without :DTYPE, and every preset names its own (qwen3:float32, llama:bfloat16)"),
    ],
)
def test_verify_refuses_a_bad_preset_case_before_building(args, message):
    from click.testing import CliRunner

    from skyrl_isoexec.cli import isoexec_group

    result = CliRunner().invoke(isoexec_group, ["verify", *args])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()), result.output
    assert "differing tokens" not in result.output
