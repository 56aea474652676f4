"""skyrl-torch runs IsoExec's ops in its lean layer walk (``InstalledOpsDecoder``), with q/k/v and
gate/up fused into one projection each. Its samples and logprobs must be bit-identical to those of
the patched transformers modules, and it must report the same op calls to the ledger."""

from __future__ import annotations

import pytest
import torch

from skyrl_core.config.schema import ModelConfig
from skyrl_core.types import GenerationRequest, SamplingParams
from skyrl_isoexec import state
from skyrl_isoexec.presets import preset
from skyrl_isoexec.verify import build_runtime


def _engines(family: str, dtype: str, on: bool):
    model = ModelConfig(config=preset(family), dtype=dtype)
    with state.enabled_scope(on):
        walk = build_runtime("inference_engine", "torch", {"max_num_seqs": 6}, model, seed=0)
        modules = build_runtime("inference_engine", "torch", {"max_num_seqs": 6, "implementation": "transformers"}, model, seed=0)
    modules.update_weights((n, p.detach()) for n, p in walk.model.named_parameters())
    return walk, modules


def _generate(engine, on: bool):
    shared = [5 + i % 40 for i in range(20)]  # a common prefix: prefilled once, then copied
    prompts = [shared + [50 + i] * (3 + 4 * i) for i in range(3)] + [[7, 8, 9]]
    requests = [
        GenerationRequest(request_id=str(i), prompt_token_ids=p, sampling=SamplingParams(n=2, max_tokens=9, seed=i, stop_token_ids=()))
        for i, p in enumerate(prompts)
    ]  # 8 samples over 6 slots: continuous batching refills freed slots
    with state.enabled_scope(on):
        return [s for group in engine.generate(requests) for s in group]


def _logprob_bits(samples) -> torch.Tensor:
    return torch.tensor([lp for s in samples for lp in s.logprobs], dtype=torch.float32).view(torch.int32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_the_walk_computes_the_bits_of_the_patched_modules(family, dtype):
    walk, modules = _engines(family, dtype, on=True)
    assert walk.execution_contract()["implementation"] == "native, installed ops"
    assert walk.native._sites["engine_decode"].fuse_projections  # IsoExec's linear allows fusing
    # fp32: every GEMM reads a oneDNN-prepacked weight (probed for the same bits); bf16 has none.
    assert walk.native.prepacked == (2 * 4 + 1 if dtype == "float32" else 0)
    a, b = _generate(walk, True), _generate(modules, True)
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    assert int((_logprob_bits(a) != _logprob_bits(b)).sum()) == 0
    # The same op calls, per (op, site, implementation) and per module: the fingerprint agrees.
    assert walk.ledger.observed == modules.ledger.observed
    assert walk.ledger.ran_modules == modules.ledger.ran_modules
    assert walk.ledger.as_dict()["model"]["unrun_modules"] == {}


def test_negative_control_stock_walk_and_stock_modules_differ():
    walk, modules = _engines("qwen3", "float32", on=False)
    assert walk.execution_contract()["implementation"] == "native"
    a, b = _generate(walk, False), _generate(modules, False)
    # Same tokens are likely, same bits are not: the stock walk fuses and reorders arithmetic.
    n = min(len(_logprob_bits(a)), len(_logprob_bits(b)))
    assert int((_logprob_bits(a)[:n] != _logprob_bits(b)[:n]).sum()) > 0


def test_a_debugging_tap_runs_the_patched_modules_with_the_same_bits():
    walk, _ = _engines("qwen3", "float32", on=True)
    plain = _generate(walk, True)
    seen: list[str] = []
    walk.model._skyrl_dispatch.tap = lambda op, module, out: seen.append(op)  # per-op digests see the modules
    tapped = _generate(walk, True)
    assert {"linear", "attention", "rms_norm", "silu_mul"} <= set(seen)
    assert int((_logprob_bits(plain) != _logprob_bits(tapped)).sum()) == 0
