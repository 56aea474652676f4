"""``verify`` through skyrl-megatron for all four families, against both engines: for each trainer
layout (family, tensor parallel, expert parallel) the trainer is built once per IsoExec setting
(for TP 2 and EP 2 with its two Ray ranks, the costly part), and skyrl-torch and vLLM-CPU each
generate against it (``verify_engines``); the trainer scores their tokens under three batch
compositions and the logprobs are compared on their int32 bits (``verify.compare_logprobs``).
IsoExec on: 0 differing tokens with each engine. Off, the negative control: both differ.

Layouts here: TP 1 (in-process) for qwen3, qwen3-moe, qwen3-next; the Ray layouts (TP 2, EP 2) are
``test_megatron_verify_parallel.py`` (the check itself: ``conftest.megatron_verify_layout``). Llama at
TP 1 goes through the CLI
(``skyrl isoexec verify --engine torch,vllm``), so its per-engine printing and exit codes are checked
on a real run; bad engine combinations are refused before anything is built.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (skyrl-megatron's trainer)")
pytest.importorskip("skyrl_megatron", reason="skyrl-megatron is not installed")

ENGINES = ("torch", "vllm")
# (preset, tensor parallel, expert parallel); llama at TP 1 is test_cli_verify_megatron_against_both_engines.
# The Ray layouts are test_megatron_verify_parallel.py: pytest-xdist runs a file on one worker, and
# all layouts in one file kept one worker busy ~8 minutes at the suite's end.
LAYOUTS = [("qwen3", 1, 1), ("qwen3-moe", 1, 1), ("qwen3-next", 1, 1)]


@pytest.fixture
def vllm_env():
    pytest.importorskip("vllm")
    # vLLM's cache is the session's isolated one (skyrl_core.testing.suite_environment): a fresh one
    # per test re-ran vLLM's model-class inspection subprocess at every engine start (~8 s).


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize(("preset", "tensor_parallel", "expert_parallel"), LAYOUTS,
                         ids=[f"{p}-tp{t}-ep{e}" for p, t, e in LAYOUTS])
def test_both_engines_get_the_megatron_trainers_bits(preset, tensor_parallel, expert_parallel, megatron_verify_layout):
    megatron_verify_layout(preset, tensor_parallel, expert_parallel)


def _cli_run(*args: str):
    from click.testing import CliRunner

    from skyrl_isoexec.cli import isoexec_group

    return CliRunner().invoke(isoexec_group, ["verify", "--preset", "llama", "--backend", "megatron", *args])


def _per_engine(output: str) -> dict[str, tuple[int, int, str, str]]:
    """engine -> (differing, tokens, trainer hash, engine hash) from the CLI's per-engine lines."""
    hashes = dict((m[0], m[1:]) for m in re.findall(r"^engine (\w+): isoexec \w+; contract hashes: trainer (\w+) engine (\w+)$", output, re.M))
    counts = {m[0]: (int(m[1]), int(m[2])) for m in re.findall(r"^engine (\w+): (\d+) differing tokens of (\d+);", output, re.M)}
    assert set(hashes) == set(counts), output
    return {engine: (*counts[engine], *hashes[engine]) for engine in counts}


@pytest.mark.slow
@pytest.mark.vllm
def test_cli_verify_megatron_against_both_engines(vllm_env):
    in_process = ("--engine-option", "vllm:multiprocess=false")
    on = _cli_run("--engine", "torch,vllm", *in_process, "--batches", "1", "--seed", "1")
    assert on.exit_code == 0, on.output
    results = _per_engine(on.output)
    assert list(results) == list(ENGINES)
    assert all(differing == 0 < tokens and trainer == engine for differing, tokens, trainer, engine in results.values())
    total = sum(tokens for _, tokens, _, _ in results.values())
    assert on.output.strip().splitlines()[-1].startswith(f"0 differing tokens of {total}; max |dlogp| = 0.000e+00 (engines torch, vllm)")
    # The same engines given as repeated options; IsoExec off: each engine differs, exit 1.
    off = _cli_run("--engine", "torch", "--engine", "vllm", *in_process, "--batches", "1", "--seed", "1", "--off")
    assert off.exit_code == 1, off.output
    stock = _per_engine(off.output)
    assert list(stock) == list(ENGINES) and all(differing > 0 for differing, *_ in stock.values())
    assert stock["torch"][2] == stock["torch"][3] != results["torch"][2]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--engine", "torch,torch"], "torch given more than once"),
        (["--engine", "torch,", ], "an empty engine name"),
        (["--engine", "torch,vllm", "--engine-option", "multiprocess=false"], "names no engine; with several engines (torch, vllm) write ENGINE:KEY=VALUE"),
        (["--engine", "torch", "--engine-option", "vllm:multiprocess=false"], "is for engine 'vllm', not among --engine torch"),
        (["--engine", "torch,vllm", "--engine-option", "vllm:kv_cache_bytes=1"], "inference_engine:vllm.kv_cache_bytes: unknown key"),
        (["--engine", "torch", "--engine-option", "max_num_seqs"], "'max_num_seqs' must look like key.path=value"),
        (["--engine", "torch,nope"], "'nope' is not a registered inference engine"),
        (["--tensor-parallel", "2", "--backend", "fsdp"], "--tensor-parallel needs --backend megatron"),
        (["--preset", "llama"], "llama given more than once"),
        (["--dtype", "float32", "--dtype", "float32"], "float32 given more than once"),
        # The backend's own pre-flight checks, as `skyrl train` runs them:
        (["--dtype", "bfloat16"], "training_backend:megatron: model.dtype: 'bfloat16' needs megatron's bf16"),
        (["--expert-parallel", "2"], "expert_parallel=2 needs a mixture-of-experts model; llama has no experts"),
        # Several cases: every one is checked before the first is built, and the refused one is named.
        (["--dtype", "float32", "--dtype", "bfloat16"], "error: llama bfloat16: training_backend:megatron: model.dtype"),
    ],
)
def test_cli_refuses_a_bad_combination_before_verifying(args, message):
    result = _cli_run(*args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "differing tokens" not in result.output  # nothing was generated or scored
