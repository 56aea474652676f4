"""``skyrl tinker serve`` refuses what it cannot do before loading anything."""

from click.testing import CliRunner

from skyrl_tinker.cli import tinker_group


def test_serve_refuses_unknown_backends(tmp_path):
    result = CliRunner().invoke(tinker_group, ["serve", "--model", str(tmp_path), "--backend", "deepspeed"])
    assert result.exit_code == 2 and "'deepspeed': allowed: fsdp, megatron" in result.output


def test_serve_refuses_bad_engine_options_naming_the_key(tmp_path):
    result = CliRunner().invoke(tinker_group, ["serve", "--model", str(tmp_path), "--engine", "torch", "--engine-option", "no_such_key=1"])
    assert result.exit_code == 2 and "no_such_key" in result.output
    result = CliRunner().invoke(tinker_group, ["serve", "--model", str(tmp_path), "--engine-option", "justakey"])
    assert result.exit_code == 2 and "expected KEY=VALUE" in result.output


def test_serve_refuses_an_unknown_cpu_gemm(tmp_path):
    result = CliRunner().invoke(tinker_group, ["serve", "--model", str(tmp_path), "--cpu-gemm", "mkl"])
    assert result.exit_code == 2 and "'mkl': allowed: auto, onednn, torch" in result.output


def test_serve_refuses_an_unknown_dtype(tmp_path):
    result = CliRunner().invoke(tinker_group, ["serve", "--model", str(tmp_path), "--dtype", "float16"])
    assert result.exit_code == 2 and "'float16' is not one of 'float32', 'bfloat16'" in result.output
