"""Attention inside vLLM on the canonical kernel (``kernels.attention.attention``), with its own KV cache.

vLLM-CPU runs one C++ kernel for every token (paged, split-KV work split chosen per batch), whose
reductions differ from the trainer's. ``IsoExecCPUBackend`` replaces ``CPU_ATTN`` (registered with
``register_backend``) and owns both sides of the KV cache:

- write (``do_kv_cache_update``): vLLM's per-layer cache ``[blocks, kv_heads, block_size, 2 * D]``
  is used as one row per (slot, kv head), ``[blocks * block_size * kv_heads, 2 * D]``: kv head
  ``h`` of token ``t`` goes to row ``slot_mapping[t] * kv_heads + h`` (key, then value);
- read (``forward``, ``attend``): every request's keys and values are gathered in one
  ``index_select`` through its block table into ``[requests * kv_heads, keys, 2 * D]``, and all
  requests of the step are computed at once with the arithmetic of the canonical kernel
  (``kernels.attention``: its score GEMM over query rows padded as it pads them and 64-key
  blocks, then its own ``scores_to_weights`` and ``weighted_values``), query ``i`` of a request
  seeing keys ``[0, start + i]``. Cache positions need no re-indexing, so the kernel's generic
  mask handling is skipped, and what the layers of a step share is derived once from its metadata.

The canonical kernel reduces over exactly the visible keys in fixed blocks aligned at the
sequence start, so a token's output is the same whether it was computed in a prefill, a chunk of
one, a decode step, with a cached prefix, or in the trainer's full forward over a padded batch
(``test_vllm_isoexec_ops.py`` compares ``attend`` with the kernel on the trainer's batch).
The metadata builder also names the step's ledger (``runtime.begin_step``); the step's site is
named by skyrl-vllm's op sites.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.v1.attention.backend import AttentionBackend, AttentionImpl, AttentionMetadataBuilder, MultipleOf
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from skyrl_isoexec.kernels import attention as canonical
from skyrl_isoexec.vllm import runtime

BACKEND_PATH = "skyrl_isoexec.vllm.attention.IsoExecCPUBackend"
CUDA_BACKEND_PATH = "skyrl_isoexec.vllm.attention.IsoExecCUDABackend"


@dataclass
class IsoExecAttentionMetadata:
    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [reqs + 1]
    seq_lens: torch.Tensor  # [reqs]
    block_table: torch.Tensor  # [reqs, max_blocks]
    slot_mapping: torch.Tensor  # [tokens]
    plans: dict = field(default_factory=dict, repr=False)  # per step, shared by its layers (_step_plan)


def build_metadata(common, ledger) -> IsoExecAttentionMetadata:
    """The step's metadata from vLLM's ``CommonAttentionMetadata``; names the step's ledger."""
    if isinstance(common.causal, torch.Tensor) or not common.causal:
        raise ValueError("IsoExec: only causal decoder attention has a canonical op")
    runtime.begin_step(ledger)
    return IsoExecAttentionMetadata(
        num_actual_tokens=int(common.num_actual_tokens),
        num_reqs=int(common.num_reqs),
        max_query_len=int(common.max_query_len),
        max_seq_len=int(common.max_seq_len),
        query_start_loc=common.query_start_loc,
        seq_lens=common.seq_lens,
        block_table=common.block_table_tensor,
        slot_mapping=common.slot_mapping,
    )


def _entry_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache as one row per (slot, kv head), ``[blocks * block_size * kv_heads, 2D]``: our own
    layout inside vLLM's ``[blocks, kv_heads, block_size, 2D]`` allocation."""
    if not kv_cache.is_contiguous():
        raise ValueError("IsoExec: the KV cache of a layer must be contiguous (vLLM's LBHNC layout)")
    return kv_cache.view(-1, kv_cache.shape[3])


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``key``/``value`` ``[T, kv_heads, D]`` at their slots (negative slots: padding, skipped)."""
    tokens = min(key.shape[0], slot_mapping.shape[0])
    slots = slot_mapping[:tokens].long()
    entries = torch.cat((key[:tokens], value[:tokens]), dim=-1)  # [T, kv_heads, 2D]
    keep = slots >= 0
    if not bool(keep.all()):
        slots, entries = slots[keep], entries[keep]
    kv_heads = kv_cache.shape[1]
    rows = slots[:, None] * kv_heads + torch.arange(kv_heads, device=slots.device)[None, :]
    _entry_rows(kv_cache).index_copy_(0, rows.reshape(-1), entries.reshape(-1, entries.shape[-1]).to(kv_cache.dtype))


@dataclass
class _StepPlan:
    """What every attention layer of one step shares (built by its first layer): where each
    request's keys are, where each query row goes, which keys each row sees."""

    kv_rows: torch.Tensor  # [reqs * kv_heads * slots] cache rows, request-major
    query_rows: torch.Tensor  # [tokens * heads] row of (token, head) in the [reqs * kv_heads * padded] buffer
    hidden: torch.Tensor  # [reqs, kv_heads, rows, slots] bool, contiguous (masked_fill is slow to broadcast)
    empty: torch.Tensor | None  # [reqs, 1, rows, 1] rows that see no key, None when there are none
    rows: int  # query rows per (request, kv head): rep * max_q
    padded_rows: int  # rows rounded up to the kernel's QUERY_ROW_PAD
    slots: int  # keys per request, a multiple of KEY_BLOCK


def _step_plan(meta: IsoExecAttentionMetadata, kv_heads: int, block_size: int, heads: int, device) -> _StepPlan:
    key = (kv_heads, block_size, heads, str(device))
    plan = meta.plans.get(key)
    if plan is not None:
        return plan
    tokens, reqs, max_q = meta.num_actual_tokens, meta.num_reqs, meta.max_query_len
    rep = heads // kv_heads
    starts = meta.query_start_loc[: reqs + 1].to(device=device, dtype=torch.long)
    seq_lens = meta.seq_lens[:reqs].to(device=device, dtype=torch.long)
    q_lens = starts[1:] - starts[:-1]

    # Keys by position, as many as the longest request needs rounded up to the kernel's key blocks.
    # Positions past a request's length read its last key: a real, finite key whose weight is an
    # exact 0 (0 * v adds nothing to a GEMM sum), so values need no zeroing and stale or unwritten
    # cache rows are never read.
    slots = -(-meta.max_seq_len // canonical.KEY_BLOCK) * canonical.KEY_BLOCK
    table = meta.block_table[:reqs].to(device=device, dtype=torch.long)
    position = torch.arange(slots, device=device)
    clamped = torch.minimum(position[None, :], (seq_lens - 1).clamp(min=0)[:, None])  # [reqs, slots]
    slot_ids = table.gather(1, clamped // block_size) * block_size + clamped % block_size
    kv_rows = slot_ids[:, None, :] * kv_heads + torch.arange(kv_heads, device=device)[None, :, None]

    # Query rows of a (request, kv head): query i, head g of the group -> row i * rep + g (rows are
    # independent of each other in the kernel's GEMMs, so any order gives the same bits).
    rows = rep * max_q
    padded_rows = -(-rows // canonical.QUERY_ROW_PAD) * canonical.QUERY_ROW_PAD
    request = torch.repeat_interleave(torch.arange(reqs, device=device), q_lens, output_size=tokens)
    query = torch.arange(tokens, device=device) - starts[request]  # [tokens]
    head = torch.arange(heads, device=device)
    query_rows = ((request[:, None] * kv_heads + head[None, :] // rep) * padded_rows
                  + query[:, None] * rep + head[None, :] % rep)

    # Query i of a request sits at position seq_len - q_len + i and sees keys [0, that + 1); rows
    # past a request's queries (padding) see its whole sequence (their output is dropped).
    seen = (seq_lens - q_lens)[:, None] + torch.arange(1, max_q + 1, device=device)[None, :]
    seen = torch.minimum(seen, seq_lens[:, None]).repeat_interleave(rep, dim=1)  # [reqs, rows]
    hidden = (position[None, None, :] >= seen[:, :, None])[:, None].expand(reqs, kv_heads, rows, slots)
    empty = (seen == 0)[:, None, :, None]
    plan = meta.plans[key] = _StepPlan(
        kv_rows=kv_rows.reshape(-1), query_rows=query_rows.reshape(-1), hidden=hidden.contiguous(),
        empty=empty if bool(empty.any()) else None, rows=rows, padded_rows=padded_rows, slots=slots,
    )
    return plan


def attend(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: IsoExecAttentionMetadata, scale: float, output: torch.Tensor
) -> None:
    """Canonical attention of the step's ``query`` ``[T, H, D]`` into ``output`` ``[T, H, D]``.

    The arithmetic of ``kernels.attention.attention`` (its score GEMM shape; its softmax and value
    steps called as they are) for causal queries over a KV cache, with the step's index work done
    once for all layers (``_StepPlan``) and no re-indexing, mask checks or padded copies: the cache
    is read by position."""
    tokens, reqs = meta.num_actual_tokens, meta.num_reqs
    if tokens == 0 or reqs == 0:
        return
    _, kv_heads, block_size, width = kv_cache.shape
    heads, dim = query.shape[1], query.shape[-1]
    plan = _step_plan(meta, kv_heads, block_size, heads, query.device)
    batch, rows, padded, slots = reqs * kv_heads, plan.rows, plan.padded_rows, plan.slots

    kv = _entry_rows(kv_cache).index_select(0, plan.kv_rows).view(batch, slots, width)
    key, value = kv[..., :dim].float(), kv[..., dim:].float()  # strided views for fp32: same GEMM bits
    q = torch.zeros(batch * padded, dim, dtype=torch.float32, device=query.device)
    q.index_copy_(0, plan.query_rows, query[:tokens].reshape(-1, dim).float())

    # Scores: one GEMM per (request, kv head), [padded rows, D] @ [D, slots]; then the kernel's own
    # steps: its softmax over the slots, its per-key-block value GEMMs and their combine.
    scores = torch.bmm(q.view(batch, padded, dim), key.transpose(1, 2)).view(reqs, kv_heads, padded, slots)
    scores[:, :, :rows].mul_(scale)  # (padding rows are dropped by the softmax)
    weights = canonical.scores_to_weights(scores, rows, plan.hidden, plan.empty)
    out = canonical.weighted_values(weights.view(batch, padded, slots), value)
    out = out.view(-1, dim).index_select(0, plan.query_rows)
    output[:tokens] = out.view(tokens, heads, dim).to(output.dtype)


def refuse_unsupported(alibi_slopes, sliding_window, kv_cache_dtype, logits_soft_cap, attn_type,
                       kv_sharing_target_layer_name, sinks) -> None:
    """Raise for attention features the canonical kernel does not compute."""
    unsupported = {
        "ALiBi slopes": alibi_slopes is not None,
        f"sliding window {sliding_window}": sliding_window is not None,
        f"logits soft cap {logits_soft_cap}": bool(logits_soft_cap),
        f"attention type {attn_type!r}": attn_type != "decoder",
        "KV sharing between layers": kv_sharing_target_layer_name is not None,
        "attention sinks": sinks is not None,
        f"KV cache dtype {kv_cache_dtype!r}": kv_cache_dtype not in ("auto", None),
    }
    found = [name for name, present in unsupported.items() if present]
    if found:
        raise ValueError(f"IsoExec: canonical attention does not support {', '.join(found)}")


class IsoExecCPUMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._isoexec = runtime.active()
        # Built right after this engine's model: its ledger receives the calls of every step.
        self._isoexec_ledger = runtime.ledger() if self._isoexec else None

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        if not self._isoexec:
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        return build_metadata(common_attn_metadata, self._isoexec_ledger)


def _forward_canonically(layer, query, kv_cache, attn_metadata, scale, output, output_scale, output_block_scale):
    """An attention layer's forward with the canonical kernel (CPU and CUDA impls alike); the new
    keys and values are already in ``kv_cache`` (``do_kv_cache_update``)."""
    if attn_metadata is None:  # vLLM's warm-up call
        return output
    if output_scale is not None or output_block_scale is not None:
        raise ValueError("IsoExec: fused output quantization has no canonical op")
    runtime.observe("attention", layer)
    attend(query, kv_cache, attn_metadata, scale, output)
    return output


class IsoExecCPUAttentionImpl(CPUAttentionBackendImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap=None, attn_type="decoder", kv_sharing_target_layer_name=None, sinks=None) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks)
        self._isoexec = runtime.active()
        if self._isoexec:
            refuse_unsupported(alibi_slopes, sliding_window, kv_cache_dtype, logits_soft_cap, attn_type,
                               kv_sharing_target_layer_name, sinks)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if not self._isoexec:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        return _forward_canonically(layer, query, kv_cache, attn_metadata, self.scale, output, output_scale,
                                    output_block_scale)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if not self._isoexec:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        write_kv(kv_cache, key, value, slot_mapping)


class IsoExecCPUBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with the canonical kernel and its own KV-cache layout."""

    @staticmethod
    def get_impl_cls():
        return IsoExecCPUAttentionImpl

    @staticmethod
    def get_builder_cls():
        return IsoExecCPUMetadataBuilder



# --- CUDA (vLLM's CUSTOM backend slot; selected with attention_config.backend="CUSTOM") ----------
# Platform-neutral torch code; not run on this CPU machine (scripts/gpu_isoexec_vllm_check.sh).


class IsoExecMetadataBuilder(AttentionMetadataBuilder):
    """The step's metadata and site. Attention never enters CUDA graphs (the default ``NEVER``)."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._isoexec_ledger = runtime.ledger()

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        return build_metadata(common_attn_metadata, self._isoexec_ledger)


class IsoExecAttentionImpl(AttentionImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, alibi_slopes=None, sliding_window=None,
                 kv_cache_dtype="auto", logits_soft_cap=None, attn_type="decoder",
                 kv_sharing_target_layer_name=None, sinks=None, **extra) -> None:
        refuse_unsupported(alibi_slopes, sliding_window, kv_cache_dtype, logits_soft_cap, attn_type,
                           kv_sharing_target_layer_name, sinks)
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = None
        self.attn_type = attn_type
        self.sliding_window = None

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        return _forward_canonically(layer, query, kv_cache, attn_metadata, self.scale, output, output_scale,
                                    output_block_scale)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        write_kv(kv_cache, key, value, slot_mapping)


class IsoExecCUDABackend(AttentionBackend):
    """The canonical kernel in vLLM's ``CUSTOM`` backend slot (CUDA, or any non-CPU platform)."""

    forward_includes_kv_cache_update = False
    supported_dtypes = [torch.float32, torch.bfloat16]
    supported_kv_cache_dtypes = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return IsoExecAttentionImpl

    @staticmethod
    def get_builder_cls():
        return IsoExecMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        return [MultipleOf(16)]

    @classmethod
    def supported_kv_cache_layouts(cls):
        return (KVCacheLayout.LBHNC,)  # each layer's cache contiguous: one row per slot


def install() -> dict[str, str]:
    """On CPU, route vLLM's CPU attention backend to ``IsoExecCPUBackend``; elsewhere, register
    ``IsoExecCUDABackend`` as vLLM's ``CUSTOM`` backend (selected by ``attention_config.backend``)."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    slot, path = (
        (AttentionBackendEnum.CPU_ATTN, BACKEND_PATH) if current_platform.is_cpu()
        else (AttentionBackendEnum.CUSTOM, CUDA_BACKEND_PATH)
    )
    register_backend(slot, path)
    return {f"AttentionBackendEnum.{slot.name}": path}


def uninstall() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    AttentionBackendEnum.CPU_ATTN.clear_override()
    AttentionBackendEnum.CUSTOM.clear_override()
