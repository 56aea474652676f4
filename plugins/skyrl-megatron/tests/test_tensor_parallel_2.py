"""Two processes as Ray actors over gloo on loopback: the contract suite at tensor parallel 2, and
the same training at TP 1, TP 2, data parallel 2 and (Qwen3-MoE) expert parallel 2."""

import pytest
import torch

from skyrl_core.config.schema import ModelConfig, TrainerConfig
from skyrl_core.models import load_causal_lm
from skyrl_core.testing.backend_contract import (
    PROMPT_LENGTHS,
    RESPONSE_LENGTHS,
    BackendContract,
    assert_weights_bitwise_equal,
    bits,
    make_batch,
    mean_logprob_loss,
    random_sequences,
)
from skyrl_megatron.backend import MegatronBackend
from skyrl_megatron.options import MegatronOptions

from megatron_test_models import TINY_LLAMA, TINY_QWEN3, TINY_QWEN3_MOE, TINY_QWEN3_NEXT

pytestmark = pytest.mark.slow


class TestMegatronTensorParallel2(BackendContract):
    @pytest.fixture(scope="class")
    @classmethod
    def backend_factory(cls, ray_session):
        return lambda model, trainer, seed: MegatronBackend(model, MegatronOptions(tensor_parallel=2), seed=seed, trainer=trainer)


def make_loss_with_entropy_bonus():
    """Token-mean negative logprob minus an entropy bonus: exercises the vocabulary-parallel entropy.

    Made inside a function so that Ray pickles it by value: the actors cannot import test modules."""

    def loss_with_entropy_bonus(logprobs, batch, entropy):
        loss = -(logprobs * batch.token_weights).sum() - 0.1 * (entropy * batch.token_weights).sum()
        return loss, {"entropy": float((entropy * batch.loss_mask).sum() / batch.loss_mask.sum())}

    return loss_with_entropy_bonus


def train_curve(options: MegatronOptions, model: dict, batch, steps: int = 5) -> tuple[torch.Tensor, list[tuple[float, float, float]], torch.Tensor]:
    """Logprobs before training, (loss, grad norm, mean entropy) per step, logprobs after training."""
    trainer = TrainerConfig(lr=1e-3, micro_batch_size=2, lr_schedule="linear", warmup_steps=1, steps=steps, grad_clip=0.5)
    with MegatronBackend(ModelConfig(config=dict(model)), options, trainer=trainer) as backend:
        first_logprobs = backend.forward(batch)
        curve = []
        for _ in range(steps):
            metrics = backend.forward_backward(batch, make_loss_with_entropy_bonus())
            stats = backend.optim_step()
            curve.append((metrics["loss"], stats["grad_norm"], metrics["entropy"]))
        last_logprobs = backend.forward(batch)
    return first_logprobs, curve, last_logprobs


# Qwen3-Next: GatedDeltaNet, gated attention and MoE layers with a gated shared expert; at TP 2 its
# MoE layers run with sequence parallelism (norms, router and shared-expert gate see each rank's
# share of the tokens; experts split by expert tensor parallelism).
@pytest.mark.parametrize("model", [TINY_QWEN3, TINY_LLAMA, TINY_QWEN3_NEXT], ids=["qwen3", "llama", "qwen3-next"])
def test_tensor_parallel_1_and_2_train_the_same_curve(ray_session, model):
    # Five rows, micro-batches of 2: the last micro-batch has one row.
    batch = make_batch(*random_sequences(PROMPT_LENGTHS + (4,), RESPONSE_LENGTHS + (3,), vocab_size=512))
    logprobs_1, curve_1, trained_1 = train_curve(MegatronOptions(tensor_parallel=1), model, batch)
    logprobs_2, curve_2, trained_2 = train_curve(MegatronOptions(tensor_parallel=2), model, batch)
    assert (logprobs_1 - logprobs_2).abs().max().item() <= 1e-5
    losses_1, norms_1, entropies_1 = zip(*curve_1)
    losses_2, norms_2, entropies_2 = zip(*curve_2)
    assert losses_2 == pytest.approx(losses_1, rel=1e-4)
    assert norms_2 == pytest.approx(norms_1, rel=1e-4)
    assert entropies_2 == pytest.approx(entropies_1, rel=1e-4)
    assert losses_1[-1] < losses_1[0]
    # grad_clip 0.5 is below the first norms: clipping happened, on the whole model's norm.
    assert norms_1[0] > 0.5
    # Adam amplifies rounding in near-zero gradient entries, so compare what the weights compute.
    assert (trained_1 - trained_2).abs().max().item() <= 1e-3
    assert (trained_1 - logprobs_1).abs().max().item() > 1e-2  # training moved them


def test_data_parallel_2_trains_like_one_process(ray_session):
    # Three rows over two replicas: replica 0 gets two, replica 1 one; gradients are summed.
    batch = make_batch(*random_sequences((3, 7, 1), (6, 2, 5), vocab_size=512))
    logprobs_1, curve_1, _ = train_curve(MegatronOptions(tensor_parallel=1), TINY_QWEN3, batch, steps=3)
    logprobs_dp, curve_dp, _ = train_curve(MegatronOptions(tensor_parallel=1, world_size=2), TINY_QWEN3, batch, steps=3)
    assert (logprobs_1 - logprobs_dp).abs().max().item() <= 1e-6
    # Later steps inherit Adam's amplification of rounding (other thread counts in the actors).
    assert [c[0] for c in curve_dp] == pytest.approx([c[0] for c in curve_1], rel=1e-4)
    assert [c[1] for c in curve_dp] == pytest.approx([c[1] for c in curve_1], rel=1e-4)


@pytest.mark.parametrize("model", [TINY_QWEN3, TINY_LLAMA, TINY_QWEN3_NEXT], ids=["qwen3-tied", "llama-untied", "qwen3-next"])
def test_hf_to_tensor_parallel_2_to_hf_is_bit_exact(ray_session, model):
    """The HF model built from the seed, sharded into two Megatron ranks and exported back."""
    expected = load_causal_lm(ModelConfig(config=dict(model)), seed=0).state_dict()
    with MegatronBackend(ModelConfig(config=dict(model)), MegatronOptions(tensor_parallel=2), seed=0) as backend:
        exported = dict(backend.export_weights())
    assert_weights_bitwise_equal(exported, dict(expected))
    # Negative control: the comparison sees a one-ulp change.
    name = "model.layers.1.self_attn.k_proj.weight"
    nudged = exported[name].clone()
    nudged.view(torch.int32)[0, 0] += 1
    assert not torch.equal(bits(nudged), bits(expected[name]))


def test_a_failing_loss_on_one_replica_closes_the_backend_instead_of_hanging(ray_session):
    batch = make_batch(*random_sequences((4, 2), (3, 3), vocab_size=512))
    first_token_of_row_0 = int(batch.input_ids[0, -4])

    def loss_failing_on_replica_0(logprobs, micro_batch):
        if int(micro_batch.input_ids[0, -4]) == first_token_of_row_0:
            raise ValueError("loss blew up")
        return -(logprobs * micro_batch.token_weights).sum(), {}

    backend = MegatronBackend(ModelConfig(config=dict(TINY_QWEN3)), MegatronOptions(world_size=2))
    with pytest.raises(ValueError, match="loss blew up"):
        backend.forward_backward(batch, loss_failing_on_replica_0)
    with pytest.raises(RuntimeError, match="closed"):
        backend.forward(batch)
    backend.close()


@pytest.mark.parametrize("model", [TINY_QWEN3_MOE, TINY_QWEN3_NEXT], ids=["qwen3-moe", "qwen3-next"])
def test_expert_parallel_2_trains_like_one_process(ray_session, model):
    """4 experts split over two ranks (2 each; Qwen3-Next's shared expert replicated). Five rows
    over two replicas in micro-batches of 2: replica 1 runs one padded pass and one empty pass to
    match replica 0's collectives."""
    batch = make_batch(*random_sequences(PROMPT_LENGTHS + (4,), RESPONSE_LENGTHS + (3,), vocab_size=512))
    logprobs_1, curve_1, trained_1 = train_curve(MegatronOptions(), model, batch, steps=3)
    logprobs_ep, curve_ep, trained_ep = train_curve(MegatronOptions(world_size=2, expert_parallel=2), model, batch, steps=3)
    assert (logprobs_1 - logprobs_ep).abs().max().item() <= 1e-5
    # The loss (with its entropy bonus) sums over micro-batches; the entropy metric is a mean of
    # micro-batch means, which depends on how rows fall into micro-batches, so it is not compared.
    for (loss_1, norm_1, _), (loss_ep, norm_ep, _) in zip(curve_1, curve_ep):
        assert loss_ep == pytest.approx(loss_1, rel=1e-4)
        assert norm_ep == pytest.approx(norm_1, rel=1e-4)  # expert gradients counted once, on their rank
    assert (trained_1 - trained_ep).abs().max().item() <= 1e-3


def test_hf_to_expert_parallel_2_to_hf_is_bit_exact(ray_session):
    model = ModelConfig(config=dict(TINY_QWEN3_MOE))
    expected = load_causal_lm(model, seed=0).state_dict()
    with MegatronBackend(model, MegatronOptions(world_size=2, expert_parallel=2), seed=0) as backend:
        assert_weights_bitwise_equal(dict(backend.export_weights()), dict(expected))


@pytest.mark.parametrize("model", [TINY_QWEN3, TINY_QWEN3_NEXT], ids=["qwen3", "qwen3-next"])
def test_replicated_weights_stay_identical_across_tensor_parallel_ranks(ray_session, model):
    """Norm weights are replicated on both ranks; Qwen3's per-head q/k norms and GatedDeltaNet's
    output norm see only each rank's heads, and under sequence parallelism (Qwen3-Next's MoE
    layers) every norm, the router and the shared expert's gate see only each rank's share of the
    tokens, so unless their gradients are summed across ranks the copies drift apart."""
    import ray

    batch = make_batch(*random_sequences(PROMPT_LENGTHS, RESPONSE_LENGTHS, vocab_size=512))
    trainer = TrainerConfig(lr=1e-2, micro_batch_size=4)
    with MegatronBackend(ModelConfig(config=dict(model)), MegatronOptions(tensor_parallel=2), trainer=trainer) as backend:
        before = ray.get(backend._actors[0]._local_weights.remote())
        for _ in range(2):
            backend.forward_backward(batch, mean_logprob_loss)
            backend.optim_step()
        rank_0, rank_1 = ray.get([actor._local_weights.remote() for actor in backend._actors])
    replicated = [name for name in rank_0 if "norm" in name or name.endswith(("router.weight", "gate_weight"))]
    assert any("q_layernorm" in name for name in replicated)
    hybrid = model is TINY_QWEN3_NEXT
    assert ("decoder.layers.0.self_attention.out_norm.weight" in replicated) == hybrid
    assert ("decoder.layers.1.mlp.router.weight" in replicated) == hybrid
    for name in replicated:
        assert not torch.equal(rank_0[name], before[name]), f"{name} did not train"
        assert torch.equal(bits(rank_0[name]), bits(rank_1[name])), f"{name} differs between the ranks"
