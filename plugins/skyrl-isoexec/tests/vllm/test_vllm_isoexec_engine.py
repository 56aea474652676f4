"""A real vLLM engine with IsoExec against the real FSDP trainer, in one process (vLLM in-process mode;
``test_vllm_isoexec_cli.py`` runs vLLM's default multiprocess mode through ``skyrl isoexec verify``).

Logprobs are compared on their fp32 bit patterns; the negative control is the same pair built with
IsoExec off. Engines and trainers are module-scoped: each vLLM start costs 10-30 s here.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from skyrl_core.config.schema import ModelConfig, TrainerConfig
from skyrl_core.types import GenerationRequest, SamplingParams
from skyrl_isoexec import state
from skyrl_isoexec.contract import ContractMismatch, build_contract, compare, handshake
from skyrl_isoexec.presets import preset
from skyrl_isoexec.verify import build_runtime, compare_logprobs, make_requests, training_batch

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

MODEL = ModelConfig(config=preset("qwen3"), dtype="float32")


@pytest.fixture(scope="module", autouse=True)
def vllm_env():
    # vLLM's cache stays the session's isolated one (skyrl_core.testing.suite_environment), shared by
    # the suite's vLLM starts: a fresh one re-ran the model-class inspection subprocess (~8 s).
    saved = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE",)}
    os.environ["HF_HUB_OFFLINE"] = "1"
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _trainer(on: bool, model: ModelConfig = MODEL):
    precision = "bf16" if model.dtype == "bfloat16" else "fp32"
    with state.enabled_scope(on):
        return build_runtime(
            "training_backend", "fsdp", {"world_size": 1, "device": "cpu", "mixed_precision": precision},
            model, seed=0, trainer=TrainerConfig(micro_batch_size=3),
        )


def _engine(on: bool, trainer, model: ModelConfig = MODEL, **options):
    from skyrl_vllm.engine import VLLMEngine
    from skyrl_vllm.options import VLLMOptions

    opts = {"kv_cache_memory_bytes": 32 << 20, "multiprocess": False, "enable_prefix_caching": True, **options}
    with state.enabled_scope(on):
        engine = VLLMEngine(model, VLLMOptions(**opts), seed=0)
    engine.update_weights(trainer.export_weights())
    return engine


@pytest.fixture(scope="module")
def trainer_on():
    trainer = _trainer(True)
    yield trainer
    trainer.close()


@pytest.fixture(scope="module")
def engine_on(trainer_on):
    engine = _engine(True, trainer_on)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def pair_off(engine_on):  # built after the IsoExec engine: one process serves both
    trainer = _trainer(False)
    engine = _engine(False, trainer)
    yield trainer, engine
    engine.close()
    trainer.close()


def _generate(engine, seed: int, batches: int = 2):
    rng = random.Random(seed)
    samples = []
    for b in range(batches):
        samples.extend(s for group in engine.generate(make_requests(rng, 512, b)) for s in group)
    return samples


def _differing(trainer, samples) -> int:
    """Differing tokens over two scoring compositions (all at once, reversed)."""
    together = compare_logprobs("all", samples, trainer.forward(training_batch(samples)))
    reverse = samples[::-1]
    reversed_ = compare_logprobs("reversed", reverse, trainer.forward(training_batch(reverse)))
    assert together.tokens >= 10  # enough tokens for the comparison to mean something
    return together.differing + reversed_.differing


def test_rollout_logprobs_are_the_trainers_bits_and_off_they_are_not(trainer_on, engine_on, pair_off):
    assert _differing(trainer_on, _generate(engine_on, seed=1)) == 0
    trainer_off, engine_off = pair_off
    assert _differing(trainer_off, _generate(engine_off, seed=1)) > 0
    # The IsoExec engine still computes the trainer's bits after an IsoExec-off engine was built here.
    assert _differing(trainer_on, _generate(engine_on, seed=2)) == 0


def test_prefix_cache_hits_and_decode_batches_keep_the_bits(trainer_on, engine_on):
    """Prompts sharing a 300-token prefix (prefix-cache hits past the first), resubmitted (all
    cached): every logprob is the trainer's, and the resubmission repeats the first run's bits."""
    rng = random.Random(5)
    shared = [rng.randrange(3, 512) for _ in range(300)]
    requests = [
        GenerationRequest(
            request_id=f"p{i}",
            prompt_token_ids=tuple(shared + [rng.randrange(3, 512) for _ in range(1 + 7 * i)]),
            sampling=SamplingParams(max_tokens=6, temperature=1.0, seed=100 + i),
        )
        for i in range(4)
    ]
    first = [s for group in engine_on.generate(requests) for s in group]
    again = [s for group in engine_on.generate(requests) for s in group]
    assert [s.token_ids for s in first] == [s.token_ids for s in again]
    first_bits = torch.tensor([lp for s in first for lp in s.logprobs]).view(torch.int32)
    again_bits = torch.tensor([lp for s in again for lp in s.logprobs]).view(torch.int32)
    assert torch.equal(first_bits, again_bits)
    assert _differing(trainer_on, first) == 0


def test_attestation_reports_what_ran_at_each_site_and_the_handshake_agrees(trainer_on, engine_on, pair_off):
    _generate(engine_on, seed=3, batches=1)
    contract = engine_on.execution_contract()
    ledger = contract["ledger"]
    model = ledger["model"]
    assert model["architecture"] == "Qwen3ForCausalLM" and model["unpatched"] == []
    assert model["installed"]["AttentionBackendEnum.CPU_ATTN"] == "skyrl_isoexec.vllm.attention.IsoExecCPUBackend"
    # vLLM's own layers call IsoExec's ops through skyrl-vllm's op sites; attention is IsoExec's own layer.
    assert model["routed"] == {op: [f"isoexec.{op}"] for op in ("embedding", "linear", "logprobs", "rms_norm", "rope", "silu_mul")}
    assert model["unrun_modules"] == {}
    _assert_ran_at_both_engine_sites(ledger, ("embedding", "linear", "rms_norm", "rope", "attention", "silu_mul", "logprobs"))
    # 2 layers x (qkv, o, gate_up, down) + lm_head; q/k norms, 2 per layer, the final norm.
    assert model["op_modules"]["linear"] == 9 and model["op_modules"]["rms_norm"] == 9

    with state.enabled_scope(True):
        trainer_c = build_contract("trainer", trainer_on.execution_contract()["ledger"], enabled=True)
        engine_c = build_contract("engine", ledger, enabled=True)
        assert engine_c["fingerprint"] == []
        assert compare(trainer_c, engine_c) == [] and trainer_c["hash"] == engine_c["hash"]

        tampered = {**engine_c, "identity": {**engine_c["identity"]}}
        tampered["identity"]["ops"] = {**engine_c["identity"]["ops"], "linear": {"impl": "torch.linear", "version": "1", "constants": {}}}
        with pytest.raises(ContractMismatch, match="hash .* does not match its content"):
            handshake(trainer_c, tampered)
        with pytest.raises(ContractMismatch, match="linear @ trainer_forward vs engine_prefill"):
            handshake(trainer_c, {**tampered, "hash": __import__("skyrl_isoexec.contract").contract.sha256(tampered["identity"])})

        # An engine that ran stock ops (IsoExec off when it was built) is refused against the trainer.
        _, engine_off = pair_off
        off_c = build_contract("engine", engine_off.execution_contract()["ledger"], enabled=True)
        problems = compare(trainer_c, off_c)
        assert any("attention @ trainer_forward vs engine_prefill" in p for p in problems), problems


def test_merged_projections_run_as_one_gemm_each(engine_on, monkeypatch):
    """vLLM's merged q/k/v and gate/up weights run as one canonical GEMM per call (the canonical
    linear's columns are independent), on prepacked weights; the attestation names them, and the
    rollout tests above prove those GEMMs give the trainer's bits."""
    from skyrl_isoexec.kernels import linear as kernel

    model = engine_on.execution_contract()["ledger"]["model"]
    # Qwen3 preset: 4 q heads and 2 kv heads of 32 channels, intermediate size 128, 2 layers.
    assert model["fused_linear"] == {
        **{f"model.layers.{i}.self_attn.qkv_proj": [128, 64, 64] for i in range(2)},
        **{f"model.layers.{i}.mlp.gate_up_proj": [128, 128] for i in range(2)},
    }
    # fp32: every linear and the lm_head compute from weights prepacked for oneDNN.
    linears = [f"model.layers.{i}.{name}" for i in range(2) for name in ("self_attn.qkv_proj", "self_attn.o_proj",
                                                                          "mlp.gate_up_proj", "mlp.down_proj")]
    assert model["prepacked_linear"] == sorted([*linears, "lm_head"])

    def linear_calls() -> int:
        ledger = engine_on.execution_contract()["ledger"]
        return sum(ledger[f"linear@{site}"]["calls"].get("isoexec.linear", 0) for site in ("engine_prefill", "engine_decode"))

    gemms = []
    matmul = kernel.row_aligned_matmul  # what one canonical linear call computes, once
    monkeypatch.setattr(kernel, "row_aligned_matmul", lambda *args: gemms.append(1) or matmul(*args))
    before = linear_calls()
    _generate(engine_on, seed=6, batches=1)
    # One GEMM per linear call, merged layers included (split pieces would make it 7 per 4 calls).
    assert len(gemms) == linear_calls() - before > 0


def test_weight_update_in_place_keeps_the_bits(trainer_on, engine_on):
    _assert_follows_a_training_step(trainer_on, engine_on, _generate(engine_on, seed=4, batches=1), seed=4)


def _train_one_step(trainer, samples) -> None:
    batch = training_batch(samples)
    trainer.forward_backward(batch, lambda logprobs, micro, **_: (-(logprobs * micro.loss_mask).sum(), {}))
    trainer.optim_step()


def _assert_follows_a_training_step(trainer, engine, samples, seed: int, batches: int = 1) -> None:
    """One optimizer step changes the trainer's logprobs; after an in-place update the engine's
    rollouts are the trainer's bits again."""
    before = trainer.forward(training_batch(samples))
    _train_one_step(trainer, samples)
    assert not torch.equal(before, trainer.forward(training_batch(samples)))  # the weights did change
    engine.update_weights(trainer.export_weights())
    assert _differing(trainer, _generate(engine, seed=seed, batches=batches)) == 0


def _assert_ran_at_both_engine_sites(ledger, ops) -> None:
    for op in ops:
        for site in ("engine_prefill", "engine_decode"):
            assert ledger[f"{op}@{site}"]["calls"].get(f"isoexec.{op}", 0) > 0, (op, site)


def test_tied_lm_head_follows_a_weight_update():
    """Llama (SmolLM2's layout) ties the lm_head to the input embedding; its prepacked weight is
    rebuilt when the embedding is reloaded, so the logprobs after an update are the trainer's."""
    model = ModelConfig(config=preset("llama"), dtype="float32")
    trainer = _trainer(True, model)
    engine = _engine(True, trainer, model)
    try:
        assert "lm_head" in engine.execution_contract()["ledger"]["model"]["prepacked_linear"]
        _assert_follows_a_training_step(trainer, engine, _generate(engine, seed=7, batches=1), seed=8)
    finally:
        engine.close()
        trainer.close()



def test_moe_routes_through_the_canonical_kernels_and_follows_a_weight_update():
    """Qwen3-MoE: vLLM's MoE runner computes the trainer's router, experts and combine (recorded at
    both engine sites), keeps the plain expert weights, and follows an in-place weight update."""
    model = ModelConfig(config=preset("qwen3-moe"), dtype="float32")
    trainer = _trainer(True, model)
    engine = _engine(True, trainer, model)
    try:
        samples = _generate(engine, seed=9, batches=1)
        assert _differing(trainer, samples) == 0
        ledger = engine.execution_contract()["ledger"]
        modules = ledger["model"]
        assert modules["architecture"] == "Qwen3MoeForCausalLM" and modules["unpatched"] == []
        assert modules["installed"]["CustomOp MoERunner"] == "skyrl_isoexec.vllm.moe.IsoExecMoERunner"
        # 2 layers x (qkv, o) + lm_head: the routers' gates are read by the MoE op, not called.
        assert modules["op_modules"]["linear"] == 5
        assert [modules["op_modules"][op] for op in ("moe_router", "moe_experts", "moe_combine")] == [2, 2, 2]
        _assert_ran_at_both_engine_sites(ledger, ("moe_router", "moe_experts", "moe_combine"))
        _assert_follows_a_training_step(trainer, engine, samples, seed=10)
    finally:
        engine.close()
        trainer.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gated_delta_net_hybrid_keeps_the_bits_across_steps_and_a_weight_update(dtype):
    """Qwen3-Next: GatedDeltaNet layers over vLLM's state cache (prefills, decodes, slots reused by
    later requests), Gemma norms, gated attention, shared experts; after an optimizer step and an
    in-place update (fp32 master weights: A_log and dt_bias, which vLLM keeps in fp32, enter in the
    model dtype) still the trainer's bits."""
    model = ModelConfig(config=preset("qwen3-next"), dtype=dtype)
    trainer = _trainer(True, model)
    # Two sequences at a time: later requests are prefilled in the steps that decode earlier ones.
    engine = _engine(True, trainer, model, max_num_seqs=2)
    try:
        samples = _generate(engine, seed=11, batches=3)
        assert _differing(trainer, samples) == 0
        ledger = engine.execution_contract()["ledger"]
        modules = ledger["model"]
        assert modules["architecture"] == "Qwen3NextForCausalLM" and modules["unpatched"] == []
        assert modules["op_modules"]["gdn_core"] == modules["op_modules"]["gdn_conv"] == 1  # one linear-attention layer
        _assert_ran_at_both_engine_sites(ledger, ("gdn_conv", "gdn_core", "moe_combine"))
        _assert_follows_a_training_step(trainer, engine, samples, seed=12, batches=2)
    finally:
        engine.close()
        trainer.close()


def test_moe_refusals_name_each_routing_the_canonical_kernels_do_not_compute():
    from types import SimpleNamespace

    from skyrl_isoexec.vllm.moe import IsoExecMoERunner, problems

    def runner(**changes):
        r = torch.nn.Module.__new__(IsoExecMoERunner)
        torch.nn.Module.__init__(r)
        weight = torch.zeros(4, 8, 16)
        settings = dict(
            _isoexec_moe=True, quant_method=None, scoring_func="softmax", use_grouped_topk=False,
            custom_routing_function=None, e_score_correction_bias=None, routed_scaling_factor=1.0,
            activation=SimpleNamespace(value="silu"), moe_config=SimpleNamespace(has_bias=False),
            apply_router_weight_on_input=False, expert_map=None, local_num_experts=4, global_num_experts=4,
            w13_weight=weight,
        )
        settings.update(changes)
        r.routed_experts = SimpleNamespace(**settings)
        r.__dict__.update(_isoexec=True, routed_scaling_factor=1.0, routed_input_transform=None,
                          routed_output_transform=None, _shared_experts=None, shared_expert_gate=None,
                          gate=SimpleNamespace(weight=torch.zeros(4, 16)))
        return r

    assert problems(runner()) == []
    assert problems(runner(scoring_func="sigmoid")) == ["scoring_func='sigmoid' (the canonical router is a softmax)"]
    assert problems(runner(use_grouped_topk=True)) == ["grouped or custom top-k routing"]
    assert problems(runner(e_score_correction_bias=torch.zeros(4))) == ["an expert score correction bias"]
    assert problems(runner(routed_scaling_factor=2.5)) == ["routed_scaling_factor=2.5"]
    assert problems(runner(activation=SimpleNamespace(value="gelu"))) == [
        "activation 'gelu' (the canonical experts compute SiLU(gate) * up)"]
    assert problems(runner(moe_config=SimpleNamespace(has_bias=True))) == ["expert biases"]
    assert problems(runner(local_num_experts=2)) == ["expert parallelism (each rank holds some experts)"]
    bf16_experts = torch.zeros(4, 8, 16, dtype=torch.bfloat16)
    assert problems(runner(w13_weight=bf16_experts)) == ["a torch.float32 router over torch.bfloat16 experts"]
    off = runner()
    off._isoexec = False  # built while IsoExec was off: vLLM's own forward
    assert problems(off) == ["it is vLLM's IsoExecMoERunner"]
