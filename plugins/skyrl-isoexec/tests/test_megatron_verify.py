"""End to end through skyrl-megatron: the skyrl-torch engine generates, Megatron's GPTModel (tensor
parallel 1 in-process, 2 as Ray actors over gloo) scores the same tokens under other batch
compositions; logprobs compared on their int32 bits (``verify.compare_logprobs``)."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (skyrl-megatron's trainer)")
pytest.importorskip("skyrl_megatron", reason="skyrl-megatron is not installed")

from skyrl_isoexec.verify import verify  # noqa: E402


def _quiet(_: str) -> None:
    pass


def _on_and_off(preset: str, tensor_parallel: int):
    on = verify(preset=preset, backend="megatron", tensor_parallel=tensor_parallel, batches=1, echo=_quiet)
    off = verify(preset=preset, backend="megatron", tensor_parallel=tensor_parallel, batches=1, off=True, echo=_quiet)
    return on, off


def _check(on, off) -> None:
    assert on.tokens > 0
    assert (on.differing, on.max_abs_diff, on.contract_problems) == (0, 0.0, ())
    assert on.trainer_hash == on.engine_hash
    # Negative control: stock Megatron numerics differ from the engine's.
    assert off.tokens > 0 and off.differing > 0
    # ... and the trainer really ran stock ops (its ranks too: they follow the driver's switch).
    assert off.trainer_hash == off.engine_hash != on.trainer_hash


@pytest.mark.parametrize("preset", ["qwen3", "llama"])
def test_megatron_tensor_parallel_1(preset):
    _check(*_on_and_off(preset, 1))


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["qwen3", "llama"])
def test_megatron_tensor_parallel_2(preset, ray_session):
    _check(*_on_and_off(preset, 2))


def test_cli_verify_backend_megatron():
    from click.testing import CliRunner

    from skyrl_isoexec.cli import isoexec_group

    runner = CliRunner()
    on = runner.invoke(isoexec_group, ["verify", "--preset", "llama", "--backend", "megatron", "--batches", "1", "--seed", "1"])
    assert on.exit_code == 0, on.output
    assert "0 differing tokens of" in on.output
    off = runner.invoke(isoexec_group, ["verify", "--preset", "llama", "--backend", "megatron", "--batches", "1", "--seed", "1", "--off"])
    assert off.exit_code == 1, off.output
    assert int(off.output.strip().splitlines()[-1].split()[0]) > 0
    refused = runner.invoke(isoexec_group, ["verify", "--preset", "llama", "--tensor-parallel", "2"])
    assert refused.exit_code == 2 and "--tensor-parallel needs --backend megatron" in refused.output
    bf16 = runner.invoke(isoexec_group, ["verify", "--preset", "llama", "--backend", "megatron", "--dtype", "bfloat16"])
    assert bf16.exit_code == 2 and "on CPU the megatron backend trains in fp32" in bf16.output
