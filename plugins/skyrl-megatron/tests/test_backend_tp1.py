"""The Megatron backend in-process (tensor parallel 1): what the contract suite does not cover."""

import re
import subprocess
import sys

import pytest
import torch

from skyrl_core.config.schema import ModelConfig, TrainerConfig
from skyrl_core.plugins import hookimpl
from skyrl_core.plugins.records import OpImplSpec
from skyrl_core.testing.backend_contract import (
    PROMPT_LENGTHS,
    RESPONSE_LENGTHS,
    check_a_failing_call_adds_no_gradient,
    hf_model_with,
    make_batch,
    random_sequences,
    reference_logprobs,
)
from skyrl_megatron import rank as rank_module
from skyrl_megatron.backend import MegatronBackend
from skyrl_megatron.options import MegatronOptions

from megatron_test_models import TINY_QWEN3

MODEL = ModelConfig(config=dict(TINY_QWEN3))


@pytest.fixture(scope="module")
def sequences():
    return random_sequences(PROMPT_LENGTHS, RESPONSE_LENGTHS, vocab_size=512)


@pytest.fixture(scope="module")
def backend():
    with MegatronBackend(MODEL, MegatronOptions(), trainer=TrainerConfig(lr=1e-3, micro_batch_size=3)) as b:
        yield b


def test_entropy_given_to_the_loss_matches_hf(backend, sequences):
    batch = make_batch(*sequences)
    hf = hf_model_with(MODEL, dict(backend.export_weights()))
    seen = {}

    def loss_with_entropy(logprobs, micro, entropy):
        # Micro-batches come length-sorted: group_ids (row numbers here) put rows back in place.
        seen.setdefault("entropy", []).append(entropy.detach())
        seen.update(zip(micro.group_ids, entropy.detach()))
        return -(logprobs * micro.token_weights).sum() - 0.01 * (entropy * micro.token_weights).sum(), {}

    backend.forward_backward(batch, loss_with_entropy)
    backend._local.optimizer.zero_grad()  # this test only looks
    assert len(seen["entropy"]) == 2  # four rows in micro-batches of three
    got = torch.stack([seen[row] for row in range(len(batch))])
    expected = torch.zeros_like(got)
    with torch.no_grad():
        for i, (prompt, response) in enumerate(zip(*sequences)):
            logits = hf(input_ids=torch.tensor([prompt + response])).logits[0].float()
            logp = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + len(response) - 1], -1)
            expected[i, : len(response)] = -(logp.exp() * logp).sum(-1)
    assert (got - expected).abs().max().item() <= 1e-5
    assert torch.all(got[batch.attention_mask[:, batch.prompt_len :] == 0] == 0)


def test_left_padding_does_not_shift_rotary_positions(backend, sequences, monkeypatch):
    batch = make_batch(*sequences)
    expected = reference_logprobs(hf_model_with(MODEL, dict(backend.export_weights())), *sequences)
    assert (backend.forward(batch) - expected).abs().max().item() <= 1e-5
    # Negative control: without moving rows to position 0, left-padded rows see shifted positions.
    monkeypatch.setattr(rank_module, "left_align", lambda ids, mask: (ids, torch.zeros(len(ids), dtype=torch.long)))
    assert (backend.forward(batch) - expected).abs().max().item() > 1e-3


def test_rows_without_a_prompt_token_are_refused(backend):
    batch = make_batch([[5, 6], [7]], [[8, 9], [10]])
    broken = batch.attention_mask.clone()
    broken[1, :2] = 0  # row 1: no real prompt token left, but a response token
    with pytest.raises(ValueError, match="no prompt token"):
        backend.forward(type(batch)(input_ids=batch.input_ids, attention_mask=broken, loss_mask=batch.loss_mask))


class _InstallShiftedLogprobs:
    """Substitutes the logprobs op at the trainer sites, as IsoExec does."""

    impl = OpImplSpec(name="test.logprobs_minus_one", op="logprobs", factory="megatron_test_models:logprobs_minus_one")

    @hookimpl(wrapper=True)
    def skyrl_install_op(self, op, site, impl):
        default = yield
        return self.impl if op == "logprobs" and site.startswith("trainer") else default


def test_an_installed_logprobs_implementation_is_what_runs(fresh_plugin_manager, sequences):
    """The IsoExec hook point: whatever ``skyrl_install_op`` installs for ``logprobs`` is declared in
    the execution contract and computes the backend's logprobs (from full-vocabulary logits)."""
    batch = make_batch(*sequences)
    with MegatronBackend(MODEL, MegatronOptions()) as stock:
        stock_logprobs = stock.forward(batch)
    fresh_plugin_manager.register_plugin(_InstallShiftedLogprobs(), "install-shifted-logprobs")
    with MegatronBackend(MODEL, MegatronOptions()) as patched:
        contract = patched.execution_contract()
        assert contract["ledger"]["logprobs@trainer_score"]["impl"] == "test.logprobs_minus_one"
        assert contract["ledger"]["logprobs@trainer_forward"]["impl"] == "test.logprobs_minus_one"
        got = patched.forward(batch)
        observed = patched._local.ledger.observed
    real = batch.attention_mask[:, batch.prompt_len :] == 1
    assert torch.allclose(got[real], stock_logprobs[real] - 1.0, atol=1e-6)
    assert observed[("logprobs", "trainer_score", "test.logprobs_minus_one")] > 0


def test_two_in_process_backends_share_megatrons_parallel_state(sequences):
    batch = make_batch(*sequences)
    first = MegatronBackend(MODEL, MegatronOptions(), seed=0)
    second = MegatronBackend(MODEL, MegatronOptions(), seed=1)
    a, b = first.forward(batch), second.forward(batch)
    first.close()
    assert torch.equal(second.forward(batch), b)  # still works after the other one closed
    second.close()
    assert not torch.equal(a, b)  # different seeds, different weights
    again = MegatronBackend(MODEL, MegatronOptions(), seed=0)  # state rebuilt from scratch
    assert torch.equal(again.forward(batch), a)
    again.close()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tensor_parallel": 2, "world_size": 3}, r"world_size \(3\) must be a multiple of tensor_parallel \(2\)"),
        ({"tensor_parallel": 0}, "tensor_parallel must be an integer >= 1; got 0"),
        ({"tensor_parallel": True}, "tensor_parallel must be an integer >= 1; got True"),  # a bool is no degree
        ({"launcher": "inprocess", "world_size": 2}, "'inprocess' runs one process, but world_size is 2"),
        ({"tensor_parallel": 2, "world_size": 2, "expert_parallel": 2}, r"expert_parallel \(2\) must divide the data-parallel degree world_size / tensor_parallel \(1\)"),
        ({"launcher": "mpi"}, "launcher must be one of auto, inprocess, ray; got 'mpi'"),
        ({"mixed_precision": "fp16"}, "mixed_precision must be one of fp32, bf16; got 'fp16'"),
    ],
)
def test_bad_options_name_what_is_allowed(options, message):
    with pytest.raises(ValueError, match=message):
        MegatronOptions(**options)


def test_bf16_on_cpu_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="bf16.*needs device 'cuda'"):
        MegatronBackend(MODEL, MegatronOptions(mixed_precision="bf16", device="cpu"))
    # The failed construction released megatron's parallel state: a new backend builds.
    MegatronBackend(MODEL, MegatronOptions()).close()


def test_registered_without_importing_torch_or_megatron(builtin_plugin_manager):
    code = (
        "import sys; import skyrl_megatron.plugin, skyrl_megatron.options, skyrl_megatron.layout; "
        "heavy = [m for m in ('torch', 'megatron', 'ray', 'transformers') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    from skyrl_core.plugins.manager import new_plugin_manager

    spec = new_plugin_manager().spec("training_backend", "megatron")
    assert spec.factory == "skyrl_megatron.backend:MegatronBackend"
    assert spec.load_options_class() is MegatronOptions


def test_moe_spec_norms_accept_sequence_parallelism_and_mark_their_weights():
    """MoE under tensor parallelism runs with sequence parallelism, which megatron's torch norm
    wrapper refuses; the spec's norms are the same torch RMSNorm, marked so that their gradients
    (each rank sees its share of the tokens) are summed over the tensor-parallel ranks."""
    import torch
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    from skyrl_megatron.norms import SequenceParallelRMSNorm, with_sequence_parallel_norms

    config = TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, normalization="RMSNorm", sequence_parallel=True,
        tensor_model_parallel_size=2,
    )
    with pytest.raises(AssertionError, match="sequence parallel not supported"):  # the reason for norms.py
        WrappedTorchNorm(config, 64, eps=1e-6)
    norm = SequenceParallelRMSNorm(config, 64, eps=1e-6)
    assert type(norm) is torch.nn.RMSNorm and norm.eps == 1e-6 and norm.weight.sequence_parallel is True
    config.sequence_parallel = False
    assert SequenceParallelRMSNorm(config, 64).weight.sequence_parallel is False

    block = with_sequence_parallel_norms(
        gpt_layer_specs.get_gpt_layer_local_spec(num_experts=4, qk_layernorm=True, normalization="RMSNorm"), num_layers=2
    )
    layer = block.layer_specs[0].submodules
    norms = (layer.input_layernorm, layer.pre_mlp_layernorm, layer.self_attention.submodules.q_layernorm,
             layer.self_attention.submodules.k_layernorm, block.layer_norm)
    assert len(block.layer_specs) == 2 and all(n is SequenceParallelRMSNorm for n in norms)


def test_hybrid_and_moe_layers_are_op_sites(fresh_plugin_manager, sequences):
    """Qwen3-Next on the op path: every GatedDeltaNet, MoE layer, norm and linear is claimed (none
    left unpatched, which IsoExec would refuse), and the layers report their ops when they run."""
    from megatron_test_models import TINY_QWEN3_NEXT

    fresh_plugin_manager.register_plugin(_InstallShiftedLogprobs(), "install-shifted-logprobs")
    with MegatronBackend(ModelConfig(config=dict(TINY_QWEN3_NEXT)), MegatronOptions()) as backend:
        ledger = backend._local.ledger
        backend.forward(make_batch(*sequences))
    assert ledger.meta["unpatched"] == []
    counts = ledger.meta["op_modules"]
    assert (counts["gdn_core"], counts["gdn_conv"]) == (1, 1)
    assert (counts["moe_router"], counts["moe_experts"], counts["moe_combine"]) == (2, 2, 2)
    # input + pre-MLP norms of 2 layers, q/k norms, GatedDeltaNet's output norm, the final norm
    assert counts["rms_norm"] == 8
    ran = {(op, site) for op, site, _ in ledger.observed}
    assert {("gdn_core", "trainer_score"), ("moe_router", "trainer_score"), ("rms_norm", "trainer_score")} <= ran


@pytest.mark.parametrize(
    ("config", "options", "message"),
    [
        ("moe", {"tensor_parallel": 3, "world_size": 3, "device": "cpu"}, r"tensor_parallel=3 does not divide the model's num_attention_heads \(4\)"),
        ("next", {"tensor_parallel": 4, "world_size": 4, "device": "cpu"}, r"tensor_parallel=4 does not divide the model's num_key_value_heads \(2\)"),
        ("dense", {"expert_parallel": 2, "world_size": 2}, "expert_parallel=2 needs a mixture-of-experts model; qwen3 has no experts"),
        ("next", {"expert_parallel": 3, "world_size": 3}, r"expert_parallel=3 does not divide the model's num_experts \(4\)"),
    ],
)
def test_preflight_refuses_splits_the_model_cannot_take(config, options, message):
    """Before any work: the same checks model construction makes (``layout.check_parallel``)."""
    from skyrl_core.config.schema import ModelConfig
    from skyrl_megatron.preflight import problems

    from megatron_test_models import TINY_QWEN3_MOE, TINY_QWEN3_NEXT

    model = {"moe": TINY_QWEN3_MOE, "next": TINY_QWEN3_NEXT, "dense": TINY_QWEN3}[config]

    class _Config:
        pass

    run = _Config()
    run.model = ModelConfig(config=dict(model))
    found = problems(run, MegatronOptions(**options))
    assert len(found) == 1 and re.search(message, found[0]), found
    # The same model at tensor parallel 2 (MoE layers with sequence parallelism, on CPU too) is accepted.
    if config != "dense":
        assert problems(run, MegatronOptions(tensor_parallel=2, world_size=2, device="cpu")) == []
    assert problems(run, MegatronOptions()) == []  # the same model at one process is fine


@pytest.mark.parametrize("accumulating", [False, True])
def test_a_call_that_fails_part_way_adds_no_gradient(sequences, accumulating):
    trainer = TrainerConfig(lr=1e-2, micro_batch_size=2)
    check_a_failing_call_adds_no_gradient(
        lambda: MegatronBackend(MODEL, MegatronOptions(), trainer=trainer), make_batch(*sequences), accumulating
    )
