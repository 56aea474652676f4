"""The contract suite and bf16 training on CUDA (nccl, one rank per GPU). Skipped without a GPU;
scripts/gpu_check.sh runs them."""

import pytest
import torch

from skyrl_core.testing.backend_contract import CudaBackendContract, check_bf16_trains_on_cuda
from skyrl_fsdp.backend import FSDPBackend
from skyrl_fsdp.options import FSDPOptions

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


class TestFSDPOnOneGPU(CudaBackendContract):
    @classmethod
    def cuda_backend(cls, model, trainer, seed):
        return FSDPBackend(model, FSDPOptions(device="cuda"), seed=seed, trainer=trainer)


@pytest.mark.parametrize(
    "world_size",
    [1, pytest.param(2, marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"))],
)
def test_bf16_trains_on_cuda_over_nccl(world_size):
    options = FSDPOptions(device="cuda", mixed_precision="bf16", world_size=world_size)
    check_bf16_trains_on_cuda(lambda model, trainer: FSDPBackend(model, options, trainer=trainer))
