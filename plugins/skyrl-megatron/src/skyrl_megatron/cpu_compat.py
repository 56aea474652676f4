"""Redirections that let megatron-core 0.16 run on CPU (gloo, no CUDA).

megatron-core assumes CUDA in a handful of places that the local (non-Transformer-Engine) GPT layer
spec reaches. ``apply()`` replaces exactly those, and only when the backend runs on CPU; on GPU it is
never called. Each redirection below names the call it replaces and why. Nothing here changes the
mathematics: the same tensors are computed, on the CPU.
"""

from __future__ import annotations

import contextlib
from functools import reduce
import operator
from typing import Iterator

import torch
import torch.distributed as dist

_applied = False


class CpuRNGStatesTracker:
    """Stands in for ``megatron.core.tensor_parallel.random.CudaRNGStatesTracker``.

    Replaces: the CUDA RNG tracker, whose ``add``/``fork`` call ``torch.cuda.get_rng_state`` /
    ``torch.cuda.manual_seed``. Why: megatron forks the "model-parallel-rng" state around attention
    dropout and embedding dropout on every forward, even with dropout 0. Here each named state is a
    CPU generator state, swapped into the default CPU generator for the duration of ``fork``.
    """

    def __init__(self) -> None:
        self.reset()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} already used")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise ValueError(f"RNG state {name!r} was never added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


class CpuMemoryBuffer:
    """Stands in for ``megatron.core.utils.GlobalMemoryBuffer``.

    Replaces: ``GlobalMemoryBuffer.get_tensor``, which allocates with
    ``device=torch.cuda.current_device()``. Why: the local attention (``DotProductAttention``)
    takes its ``baddbmm`` output buffer from it on every forward.
    """

    def __init__(self) -> None:
        self.buffer: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):  # noqa: ARG002 - megatron's signature
        required = reduce(operator.mul, tensor_shape, 1)
        held = self.buffer.get((name, dtype))
        if held is None or held.numel() < required:
            held = self.buffer[(name, dtype)] = torch.empty(required, dtype=dtype)
        return held[:required].view(*tensor_shape)


def _rotary_emb_on_cpu(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    """``RotaryEmbedding.get_emb`` without its move of ``inv_freq`` to the current CUDA device.

    Replaces: ``RotaryEmbedding.get_emb``, whose first line moves ``inv_freq`` to
    ``torch.cuda.current_device()`` whenever it is on the CPU. Why: that is the only CUDA call in the
    rotary path; the rest of the body is reproduced unchanged (non-interleaved and interleaved).
    """
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    if not self.rotary_interleaved:
        emb = torch.cat((freqs, freqs), dim=-1)
    else:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    return emb[:, None, None, :]


def _router_gating_on_cpu(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - megatron's name
    """``Router.gating`` on the CPU: the router logits in the routing dtype.

    Replaces: ``Router.gating``, which moves ``weight``/``bias`` to ``torch.cuda.current_device()``
    whenever they are on the CPU, then calls ``moe_utils.router_gating_linear``, whose autograd
    function names Transformer Engine's ``te_general_gemm`` unguarded (a NameError without TE).
    Why: MoE layers route every token through it. Here: the same linear in the routing dtype
    (``moe_router_dtype``, else the input's), with plain torch autograd.
    """
    router_dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
    bias = None if self.bias is None else self.bias.to(router_dtype)
    return torch.nn.functional.linear(input.to(router_dtype), self.weight.to(router_dtype), bias)


def _gather_along_first_dim_on_cpu(input_, group, output_split_sizes=None, use_global_buffer=False):
    """``tensor_parallel.mappings._gather_along_first_dim`` allocating where its input lives.

    Replaces: the function of that name, which allocates its output with
    ``device=torch.cuda.current_device()`` (unless it borrows the global buffer). Why: expert
    parallelism (the all-gather token dispatcher) and sequence parallelism gather through it.
    Same collectives and layout otherwise.
    """
    if group.size() == 1:
        return input_
    if output_split_sizes is None:
        output = _output_buffer(input_, (input_.shape[0] * group.size(), *input_.shape[1:]), use_global_buffer)
        dist.all_gather_into_tensor(output, input_.contiguous(), group=group)
        return output
    output = _output_buffer(input_, (sum(output_split_sizes), *input_.shape[1:]), use_global_buffer)
    dist.all_gather(list(torch.split(output, output_split_sizes, dim=0)), input_, group=group)
    return output


def _reduce_scatter_along_first_dim_on_cpu(input_, group, input_split_sizes=None, use_global_buffer=False):
    """``tensor_parallel.mappings._reduce_scatter_along_first_dim`` allocating where its input lives.

    Replaces: the function of that name (``device=torch.cuda.current_device()``). Why: the backward
    of the gathers above, and the sequence-parallel reduce-scatter, run through it.
    """
    if group.size() == 1:
        return input_
    if input_split_sizes is None:
        if input_.shape[0] % group.size():
            raise ValueError("first dimension of the tensor should be divisible by the group size")
        output = _output_buffer(input_, (input_.shape[0] // group.size(), *input_.shape[1:]), use_global_buffer)
        dist.reduce_scatter_tensor(output, input_.contiguous(), group=group)
        return output
    pieces = list(torch.split(input_, input_split_sizes, dim=0))
    output = _output_buffer(input_, tuple(pieces[group.rank()].shape), use_global_buffer)
    dist.reduce_scatter(output, pieces, group=group)
    return output


def _output_buffer(input_: torch.Tensor, shape: tuple[int, ...], use_global_buffer: bool) -> torch.Tensor:
    if use_global_buffer:
        from megatron.core.parallel_state import get_global_memory_buffer

        return get_global_memory_buffer().get_tensor(shape, input_.dtype, "mpu")
    return torch.empty(shape, dtype=input_.dtype, device=input_.device)


class _CudaDeviceIsCpu:
    """``torch.cuda`` as a redirected module sees it on CPU: ``current_device()`` is the CPU."""

    def __getattr__(self, name: str):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> str:
        return "cpu"


class _TorchOnCpu:
    """The ``torch`` name inside one megatron module whose functions allocate on
    ``torch.cuda.current_device()``: torch, except that this device is the CPU."""

    cuda = _CudaDeviceIsCpu()

    def __getattr__(self, name: str):
        return getattr(torch, name)


def _tensor_parallel_layers_on_cpu() -> None:
    """megatron's tensor-parallel linears under sequence parallelism on the CPU.

    Replaces, in ``megatron.core.tensor_parallel.layers`` only: the ``torch`` name. Why: under
    sequence parallelism (MoE layers under tensor parallelism need it) the backward of
    ``LinearWithGradAccumulationAndAsyncCommunication`` allocates its reduce-scattered input
    gradient on ``torch.cuda.current_device()``; nothing else changes.
    """
    from megatron.core.tensor_parallel import layers

    layers.torch = _TorchOnCpu()


def _l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """flash-linear-attention's ``l2norm`` in torch (transformers' Qwen3-Next form)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def _gated_delta_net_on_cpu() -> None:
    """megatron's ``GatedDeltaNet`` on the CPU.

    Replaces, in ``megatron.core.ssm.gated_delta_net`` only: the ``torch`` name (its constructor
    allocates the conv and the A_log / dt_bias parameters on ``torch.cuda.current_device()``), the
    flash-linear-attention kernels it requires (``HAVE_FLA``; ``l2norm``; ``chunk_gated_delta_rule``
    by the module's own torch reference ``torch_chunk_gated_delta_rule``, the one its
    ``deterministic_mode`` runs), and the ``torch.compile``-wrapped ``_apply_gated_norm`` by the
    plain function (inductor would compile C++ on every new shape). Why: flash-linear-attention and
    causal-conv1d are Triton/CUDA-only; without causal-conv1d the module already uses ``nn.Conv1d``.
    """
    from megatron.core.ssm import gated_delta_net as gdn

    gdn.torch = _TorchOnCpu()
    gdn.HAVE_FLA = True
    gdn.l2norm = _l2norm
    gdn.chunk_gated_delta_rule = gdn.torch_chunk_gated_delta_rule
    norm = gdn.GatedDeltaNet._apply_gated_norm
    gdn.GatedDeltaNet._apply_gated_norm = getattr(norm, "_torchdynamo_orig_callable", norm)


def apply(seed: int) -> None:
    """Install the CPU redirections (idempotent) and seed the RNG tracker like
    ``tensor_parallel.model_parallel_cuda_manual_seed`` would (which calls ``torch.cuda.manual_seed``).

    Call after ``parallel_state.initialize_model_parallel``.
    """
    global _applied
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings import rotary_pos_embedding
    from megatron.core.tensor_parallel import random as mp_random
    from megatron.core.transformer.moe import router

    from megatron.core.tensor_parallel import mappings

    if not _applied:
        rotary_pos_embedding.RotaryEmbedding.get_emb = _rotary_emb_on_cpu
        router.Router.gating = _router_gating_on_cpu
        mappings._gather_along_first_dim = _gather_along_first_dim_on_cpu
        mappings._reduce_scatter_along_first_dim = _reduce_scatter_along_first_dim_on_cpu
        _gated_delta_net_on_cpu()
        _tensor_parallel_layers_on_cpu()
        _applied = True
    # initialize_model_parallel created a CUDA GlobalMemoryBuffer; swap in the CPU one.
    parallel_state._GLOBAL_MEMORY_BUFFER = CpuMemoryBuffer()

    tracker = CpuRNGStatesTracker()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    # The same seeds megatron derives in model_parallel_cuda_manual_seed.
    tracker.add(mp_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mp_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)
    mp_random._CUDA_RNG_STATE_TRACKER = tracker
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
