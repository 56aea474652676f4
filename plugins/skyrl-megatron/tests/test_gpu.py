"""The Megatron backend on CUDA: Transformer Engine layers when installed (else the local spec),
megatron-core's DDP wrapper and optimizer, nccl. Skipped without a GPU; scripts/gpu_megatron_check.sh
runs them (one GPU, under 10 minutes)."""

import pytest
import torch

from skyrl_core.config.schema import ModelConfig
from skyrl_core.testing.backend_contract import (
    PROMPT_LENGTHS,
    RESPONSE_LENGTHS,
    TINY_QWEN3,
    CudaBackendContract,
    check_bf16_trains_on_cuda,
    make_batch,
    random_sequences,
)
from skyrl_megatron.backend import MegatronBackend
from skyrl_megatron.options import MegatronOptions

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


class TestMegatronOnOneGPU(CudaBackendContract):
    # Transformer Engine kernels, like the other CUDA ones, reduce in other orders than the CPU reference.
    @classmethod
    def cuda_backend(cls, model, trainer, seed):
        return MegatronBackend(model, MegatronOptions(device="cuda"), seed=seed, trainer=trainer)


class TestMegatronQwen3MoEOnOneGPU(TestMegatronOnOneGPU):
    # Transformer Engine layers, the all-to-all token dispatcher, megatron's DDP over expert weights.
    micro_batch_update_rtol = 0.2  # as on CPU: Adam's first step magnifies ~1e-9 expert gradients

    @pytest.fixture(scope="class")
    @classmethod
    def model_config(cls):
        from megatron_test_models import TINY_QWEN3_MOE

        return ModelConfig(config=dict(TINY_QWEN3_MOE))


class TestMegatronQwen3NextOnOneGPU(TestMegatronOnOneGPU):
    # The hybrid's local-module spec on CUDA: megatron's GatedDeltaNet with flash-linear-attention.
    micro_batch_update_rtol = 0.2

    @pytest.fixture(scope="class")
    @classmethod
    def model_config(cls):
        pytest.importorskip("fla", reason="megatron's GatedDeltaNet needs flash-linear-attention on GPU")
        from megatron_test_models import TINY_QWEN3_NEXT

        return ModelConfig(config=dict(TINY_QWEN3_NEXT))


def test_bf16_trains_with_megatrons_optimizer():
    options = MegatronOptions(device="cuda", mixed_precision="bf16")
    check_bf16_trains_on_cuda(lambda model, trainer: MegatronBackend(model, options, trainer=trainer))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensor_parallel_2_matches_1_on_gpus():
    batch = make_batch(*random_sequences(PROMPT_LENGTHS, RESPONSE_LENGTHS, vocab_size=512))
    results = []
    for tp in (1, 2):
        with MegatronBackend(ModelConfig(config=dict(TINY_QWEN3)), MegatronOptions(device="cuda", tensor_parallel=tp)) as backend:
            results.append(backend.forward(batch))
    assert (results[0] - results[1]).abs().max().item() <= 1e-4


def test_isoexec_builds_local_layers_in_bf16_where_transformer_engine_is_installed():
    """IsoExec paired with Megatron in bf16 where Transformer Engine is installed: the op sites map
    megatron's local layers only, so with IsoExec's ops installed the rank builds the local spec in
    bf16 (``skyrl_megatron.layer_spec``) and every op maps (nothing unpatched); IsoExec off builds
    Transformer Engine's layers. The bits against CUDA vLLM: plugins/skyrl-isoexec/tests/vllm/test_vllm_isoexec_gpu.py."""
    pytest.importorskip("transformer_engine", reason="the choice is between TE and local layers: needs transformer_engine")
    pytest.importorskip("skyrl_isoexec", reason="skyrl-isoexec is not installed")
    from skyrl_isoexec import state
    from skyrl_isoexec.contract import build_contract

    model = ModelConfig(config=dict(TINY_QWEN3), dtype="bfloat16")
    contracts = {}
    for on in (True, False):
        with state.enabled_scope(on):
            with MegatronBackend(model, MegatronOptions(device="cuda", mixed_precision="bf16")) as backend:
                contracts[on] = backend.execution_contract()
    assert (contracts[True]["layer_spec"], contracts[True]["mixed_precision"]) == ("local", "bf16")
    assert "installed op implementations" in contracts[True]["layer_spec_reason"]
    assert contracts[False]["layer_spec"] == "transformer_engine"
    assert not contracts[True]["ledger"]["model"]["unpatched"]
    problems = build_contract("trainer", contracts[True]["ledger"], enabled=True)["fingerprint"]
    assert not any("has no IsoExec mapping" in p for p in problems), problems
