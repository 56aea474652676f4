"""The training-backend contract suite on one in-process rank (tensor parallel 1, gloo, CPU), for a
tied-embedding Qwen3, an untied Llama, a Qwen3-MoE (4 experts, top 2) and the Qwen3-Next hybrid
(a GatedDeltaNet layer and a gated-attention layer, experts with a gated shared expert)."""

import pytest

from skyrl_core.config.schema import ModelConfig
from skyrl_core.testing.backend_contract import BackendContract
from skyrl_megatron.backend import MegatronBackend
from skyrl_megatron.options import MegatronOptions

from megatron_test_models import TINY_LLAMA, TINY_QWEN3, TINY_QWEN3_MOE, TINY_QWEN3_NEXT


class _InProcess(BackendContract):
    @pytest.fixture(scope="class")
    @classmethod
    def backend_factory(cls):
        return lambda model, trainer, seed: MegatronBackend(model, MegatronOptions(tensor_parallel=1), seed=seed, trainer=trainer)


@pytest.mark.parametrize("model_config", [TINY_QWEN3, TINY_LLAMA], ids=["qwen3-tied", "llama-untied"], indirect=True, scope="class")
class TestMegatronTensorParallel1(_InProcess):
    @pytest.fixture(scope="class")
    @classmethod
    def model_config(cls, request):
        return ModelConfig(config=dict(request.param))


class TestMegatronQwen3MoE(_InProcess):
    # Gradients at micro-batch sizes 1 and 4 agree to ~1e-9 (test_moe_micro_batch_gradients), but
    # expert and embedding entries as small as ~1e-9 make Adam's first step (lr * g / (|g| + eps))
    # turn that rounding into up to ~10% of lr.
    micro_batch_update_rtol = 0.2

    @pytest.fixture(scope="class")
    @classmethod
    def model_config(cls):
        return ModelConfig(config=dict(TINY_QWEN3_MOE))


class TestMegatronQwen3Next(_InProcess):
    micro_batch_update_rtol = 0.2  # experts, as for Qwen3-MoE above

    @pytest.fixture(scope="class")
    @classmethod
    def model_config(cls):
        return ModelConfig(config=dict(TINY_QWEN3_NEXT))


def test_moe_micro_batch_gradients():
    from skyrl_core.config.schema import TrainerConfig
    from skyrl_core.testing.backend_contract import PROMPT_LENGTHS, RESPONSE_LENGTHS, make_batch, mean_logprob_loss, random_sequences

    batch = make_batch(*random_sequences(PROMPT_LENGTHS, RESPONSE_LENGTHS, vocab_size=512))
    grads = []
    for micro_batch_size in (1, 4):
        with MegatronBackend(ModelConfig(config=dict(TINY_QWEN3_MOE)), MegatronOptions(), trainer=TrainerConfig(micro_batch_size=micro_batch_size)) as backend:
            backend.forward_backward(batch, mean_logprob_loss)
            grads.append({n: p.grad.clone() for n, p in backend._local.model.named_parameters()})
    expert = "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"
    assert grads[0][expert].abs().max().item() > 1e-4  # the expert was routed to and learns
    worst = max((grads[0][n] - grads[1][n]).abs().max().item() for n in grads[0])
    assert worst <= 1e-6, worst
