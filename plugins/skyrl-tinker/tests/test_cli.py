"""``skyrl tinker serve`` refuses what it cannot do before loading anything."""

from click.testing import CliRunner

from skyrl_tinker.cli import tinker_group


def test_serve_refuses_unknown_backends(tmp_path):
    result = CliRunner().invoke(tinker_group, ["serve", "--model", str(tmp_path), "--backend", "deepspeed"])
    assert result.exit_code == 2 and "'deepspeed': allowed: fsdp, megatron" in result.output


def test_serve_refuses_a_cpu_gemm_the_backend_would_not_follow(tmp_path):
    """megatron has no cpu_gemm option: an explicit choice would be accepted and ignored."""
    result = CliRunner().invoke(tinker_group, ["serve", "--model", str(tmp_path), "--backend", "megatron", "--cpu-gemm", "onednn"])
    assert result.exit_code == 2 and "the megatron backend computes with its own layers' products" in result.output
    from skyrl_tinker.backend_trainer import takes_cpu_gemm

    assert takes_cpu_gemm("fsdp") and not takes_cpu_gemm("megatron")


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
