"""Op sites in megatron-core's layers: each layer that computes an op calls the implementation
installed at the current site (``skyrl_core.ops``), the way ``skyrl_core.ops.hf`` routes a
transformers model.

``patch_megatron_model`` is the patcher the backend gives ``prepare_model``: it runs only when a
plugin installed a non-stock implementation somewhere, and then each patched layer asks the model's
``OpDispatch`` (``skyrl_core.ops.dispatch``) per call. Where the stock implementation is installed
at the current site, the layer's own forward runs unchanged (megatron's numerics, its collectives).
Where another is installed, it is called with the op's calling convention (``skyrl_core.ops.hf``)
**on the shapes a transformers model of the same weights computes on**, whatever the tensor-parallel
degree, so that an implementation whose bits depend only on its inputs gives the same bits here as
in a transformers runtime:

========================  ===============  ==========================================================
megatron layer            op               installed path
========================  ===============  ==========================================================
VocabParallelEmbedding    embedding        each rank looks its own rows up (the op on its shard, ids
                                           outside it masked to 0); the ranks' lookups are all-gathered
                                           and each token takes its owner's row: a selection, no sum
                                           (megatron's all-reduce of zeros would turn -0.0 into +0.0)
ColumnParallelLinear      linear           the weight shards are all-gathered and put back into the
                                           transformers projections (``linear_qkv`` -> q, k, v;
                                           ``linear_fc1`` -> gate, up; ``output_layer`` -> the real
                                           vocabulary rows); the op runs once per projection on the
                                           full shapes and the rank keeps its own columns
RowParallelLinear         linear           input and weight shards are all-gathered along K; the op
                                           runs on the full shapes; every rank holds the whole output
                                           (no partial sums, no all-reduce)
torch.nn.RMSNorm          rms_norm         ``fn(x, weight, eps, False, None)`` (norms are replicated);
UnitOffsetRMSNorm                          ``UnitOffsetRMSNorm`` (Qwen3-Next): ``unit_offset`` True
RotaryEmbedding           rope             cos/sin from ``fn(inv_freq, mscale, positions, dtype)``,
                                           applied as transformers applies them
                                           (``t * cos + rotate_half(t) * sin``)
DotProductAttention       attention        ``fn`` on this rank's heads (a head's result depends on its
                                           own query/key/value only): ``[S, B, H, D]`` -> ``[B, H, S, D]``
MLP (dense SwiGLU)        silu_mul         ``fn(gate, up)`` between the (patched) fc1 and fc2
MoELayer                  moe_router,      router, experts (all of them, gathered over the expert-
                          moe_experts,     parallel group) and combine on this rank's tokens, as
                          moe_combine      transformers' sparse-MoE block computes them (``moe_sites``)
GatedDeltaNet             gdn_conv,        conv and delta rule on this rank's channels / heads, the
                          gdn_core         output norm as ``rms_norm`` gated by ``z`` (``gdn_sites``)
========================  ===============  ==========================================================

Under sequence parallelism (MoE models at tensor parallel > 1: between layers each rank holds a
share of the sequence) the same paths run on the whole sequence where megatron's layer does: the
embedding keeps the rank's share of the selected rows, a column-parallel linear first gathers the
ranks' shares (megatron's gather; backward reduce-scatters), a row-parallel linear keeps the rank's
share of its whole output (backward all-gathers). Norms, router, experts and combine run per token
on the rank's share: a token's bits do not depend on which rank holds it.

The price of tensor-parallel independence: every rank computes every projection in full (``tp``
times the GEMM work of the layer, plus all-gathers of weights each call); at tensor parallel 1
nothing is gathered and each GEMM is computed once. Gradients are the ordinary ones of this rank's
shard (``grad @ W_r``, ``grad.T @ x_r``, megatron's input-gradient all-reduce for column-parallel
layers), so training keeps megatron's gradient semantics.

Rotary application is megatron's ``apply_rotary_pos_emb`` (imported by name into
``megatron.core.transformer.attention``); that name is replaced, process-wide, by a function that
runs megatron's own one unless the rotary tensor comes from a patched ``RotaryEmbedding`` whose
installed ``rope`` is not stock. Anything computing an op that is not in the table (Transformer
Engine layers, MoE layers other than softmax top-k SwiGLU ones, other norms, rotary variants) is left alone and listed in
``ledger.meta["unpatched"]``, so that a plugin requiring every op (IsoExec) refuses the model.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from skyrl_core.ops.dispatch import PatchRecord, attach_dispatch
from skyrl_core.ops.ledger import OpLedger
from skyrl_megatron.columns import ColumnLayout
from skyrl_megatron.gdn_sites import gdn_forward
from skyrl_megatron.moe_sites import check_moe_layer, moe_layer_forward

# Class names of megatron modules that compute an op this patcher has no mapping for.
_COMPUTING_SUFFIXES = ("Norm", "Linear", "Attention", "Embedding", "MLP", "MoELayer", "Router", "Experts", "DeltaNet")
# Containers: they compute nothing themselves beyond elementwise residual adds and reshapes.
_CONTAINERS = {"SelfAttention", "LanguageModelEmbedding"}


# --- tensor-parallel helpers -----------------------------------------------------------------------


def _world(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_gather(t: torch.Tensor, group: Any) -> list[torch.Tensor]:
    if _world(group) == 1:
        return [t]
    parts = [torch.empty_like(t) for _ in range(_world(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


class _LocalShardLinear(torch.autograd.Function):
    """Forward: ``compute()`` (the installed op on gathered, full shapes: no autograd inside);
    backward: the ordinary gradients of this rank's ``y = x @ weight.T``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, compute: Callable[[], torch.Tensor]) -> torch.Tensor:  # noqa: ARG004
        ctx.save_for_backward(x, weight)
        return compute()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight.to(grad.dtype)) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = grad.reshape(-1, grad.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]).to(grad.dtype)).to(weight.dtype)
        return grad_x, grad_w, None


class _GatherStack(torch.autograd.Function):
    """All-gather onto a new leading dim ``[tp, ...]``; backward keeps this rank's entry (every rank
    computes the same thing from the stack, so its gradient of the stack is the whole gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.rank = dist.get_rank(group)
        return torch.stack(_all_gather(x, group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.rank], None


def _keep_sequence_share(full: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's share of the sequence (dim 0) of a tensor every rank holds whole; backward
    all-gathers the shares' gradients (megatron's ``scatter_to_sequence_parallel_region``)."""
    from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region

    return scatter_to_sequence_parallel_region(full, group=group)


def _column_layout(qualname: str, module: Any, vocab_size: int | None) -> ColumnLayout:
    config = module.config
    tp = _world(module.tp_group)
    rows = module.output_size_per_partition * tp
    leaf = qualname.rsplit(".", 1)[-1]
    if leaf == "linear_qkv":
        heads, groups = config.num_attention_heads, config.num_query_groups or config.num_attention_heads
        layout = ColumnLayout.fused_qkv(groups, heads // groups, config.kv_channels, output_gate=config.attention_output_gate)
    elif leaf == "in_proj":  # GatedDeltaNet's (the only megatron layer here with that name)
        layout = ColumnLayout.gdn_in_proj(
            config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim,
            config.linear_value_head_dim, tp,
        )
    elif leaf == "linear_fc1" and config.gated_linear_unit:
        layout = ColumnLayout.gate_up(rows // 2, tp)
    elif leaf == "output_layer" and vocab_size is not None:
        layout = ColumnLayout.plain(rows, vocab_size)
    else:
        layout = ColumnLayout.plain(rows)
    if layout.position.numel() != rows:
        raise ValueError(f"{qualname}: {rows} gathered rows, but its layout describes {layout.position.numel()}")
    return layout


# --- per-op forwards -----------------------------------------------------------------------------------


def _refuse(module: Any, what: str) -> None:
    raise NotImplementedError(f"{module._skyrl_name}: {what} is not supported with a non-stock op installed")


def _embedding_forward(module, input_):
    def installed(fn):
        group = module.tp_group
        if _world(group) == 1:
            return fn(input_, module.weight, None)
        outside = (input_ < module.vocab_start_index) | (input_ >= module.vocab_end_index)
        local = fn((input_ - module.vocab_start_index).masked_fill(outside, 0), module.weight, None)
        stack = _GatherStack.apply(local, group)  # [tp, ..., H]
        owner = (input_ // module.weight.shape[0]).clamp(0, _world(group) - 1)
        index = owner.unsqueeze(0).unsqueeze(-1).expand(1, *local.shape)
        selected = stack.gather(0, index).squeeze(0)  # [B, S, H]
        if module.reduce_scatter_embeddings:  # sequence parallelism: [S/tp, B, H], as megatron's
            return _keep_sequence_share(selected.transpose(0, 1).contiguous(), group)
        return selected

    return module._skyrl_dispatch.call("embedding", module, lambda: module._skyrl_stock_forward(input_), installed)


def _column_forward(module, input_, weight=None, runtime_gather_output=None):
    def stock():
        return module._skyrl_stock_forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)

    def installed(fn):
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        if module.explicit_expert_comm:
            _refuse(module, "expert communication")
        if module.bias is not None and not module.skip_bias_add:
            _refuse(module, "a bias")
        gather = module.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather:
            _refuse(module, "gather_output")
        w = module.weight if weight is None else weight
        group, layout = module.tp_group, module._skyrl_columns
        if module.sequence_parallel:  # the ranks' sequence shares gathered; backward: reduce-scatter dgrad
            x = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=group)
        else:
            x = copy_to_tensor_model_parallel_region(input_, group=group)  # backward: all-reduce dgrad
        rank, local = (dist.get_rank(group) if _world(group) > 1 else 0), w.shape[0]

        def compute():
            full = torch.cat(_all_gather(w, group)) if _world(group) > 1 else w
            hf = full.index_select(0, layout.hf_rows.to(full.device))
            outs = [fn(x, piece, None) for piece in hf.split(layout.sizes)]
            outs.append(outs[0].new_zeros(*outs[0].shape[:-1], 1))  # the column of gathered rows not computed
            mine = layout.position[rank * local : (rank + 1) * local].to(x.device)
            return torch.cat(outs, dim=-1).index_select(-1, mine)

        return _LocalShardLinear.apply(x, w, compute), (module.bias if module.skip_bias_add else None)

    return module._skyrl_dispatch.call("linear", module, stock, installed)


def _row_forward(module, input_):
    def installed(fn):
        if module.explicit_expert_comm or not module.input_is_parallel:
            _refuse(module, "expert communication / a non-parallel input")
        if module.bias is not None and not module.skip_bias_add:
            _refuse(module, "a bias")
        group, w = module.tp_group, module.weight

        def compute():
            if _world(group) == 1:
                return fn(input_, w, None)
            x_full = torch.cat(_all_gather(input_, group), dim=-1)
            return fn(x_full, torch.cat(_all_gather(w, group), dim=1), None)

        out = _LocalShardLinear.apply(input_, w, compute)
        if module.sequence_parallel:  # the whole output on every rank: keep this rank's sequence share
            out = _keep_sequence_share(out, group)
        return out, (module.bias if module.skip_bias_add else None)

    return module._skyrl_dispatch.call("linear", module, lambda: module._skyrl_stock_forward(input_), installed)


def _rms_norm_forward(module, x):
    def installed(fn):
        eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps
        return fn(x, module.weight, float(eps), module._skyrl_unit_offset, None)

    return module._skyrl_dispatch.call("rms_norm", module, lambda: module._skyrl_stock_forward(x), installed)


def _rope_forward(module, max_seq_len, offset=0, packed_seq=False, cp_group=None):
    """Megatron's rotary angles ``[S, 1, 1, D]``, marked with their source: the installed ``rope``
    is resolved where they are applied (``_apply_rotary``), in the dtype of the tensor rotated."""
    emb = module._skyrl_stock_forward(max_seq_len, offset, packed_seq, cp_group)
    marked = emb.view_as(emb)  # a new tensor object: megatron caches ``emb`` (lru_cache)
    marked._skyrl_rope = (module, int(offset), bool(packed_seq), cp_group)
    return marked


_STOCK_APPLY: dict[str, Callable[..., Any]] = {}


def _rotate_half(t: torch.Tensor) -> torch.Tensor:
    first, second = torch.chunk(t, 2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _apply_rotary(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None):
    """Stands in for megatron's ``apply_rotary_pos_emb`` in ``megatron.core.transformer.attention``."""
    stock = _STOCK_APPLY["apply_rotary_pos_emb"]
    source = getattr(freqs, "_skyrl_rope", None)
    if source is None:
        return stock(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)
    module, offset, packed_seq, rope_cp_group = source
    dispatch = module._skyrl_dispatch
    fn = dispatch.resolve("rope", module)
    if fn is None:
        out = stock(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)
        dispatch.emit("rope", module, out)
        return out
    if cu_seqlens is not None or packed_seq or config.rotary_interleaved or config.multi_latent_attention:
        _refuse(module, "packed sequences / interleaved rotary / multi-latent attention")
    if _world(rope_cp_group if rope_cp_group is not None else module.cp_group) > 1:
        _refuse(module, "context parallelism")
    seq = t.shape[0]
    positions = torch.arange(offset, offset + seq, device=t.device).unsqueeze(0)  # [1, S]
    cos, sin = fn(module.inv_freq, float(mscale), positions, t.dtype)  # [1, S, D]
    dispatch.emit("rope", module, (cos, sin))
    cos, sin = cos[0][:, None, None, :], sin[0][:, None, None, :]  # [S, 1, 1, D] for [S, B, H, D]
    rot = cos.shape[-1]
    head, rest = t[..., :rot], t[..., rot:]
    out = (head * cos) + (_rotate_half(head) * sin)
    return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)


def _install_rotary_application() -> None:
    from megatron.core.transformer import attention

    if "apply_rotary_pos_emb" not in _STOCK_APPLY:
        _STOCK_APPLY["apply_rotary_pos_emb"] = attention.apply_rotary_pos_emb
        attention.apply_rotary_pos_emb = _apply_rotary


def _attention_forward(module, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
    def stock():
        return module._skyrl_stock_forward(
            query, key, value, attention_mask, attn_mask_type=attn_mask_type, attention_bias=attention_bias,
            packed_seq_params=packed_seq_params,
        )

    def installed(fn):
        if packed_seq_params is not None or attention_bias is not None or module.softmax_offset is not None:
            _refuse(module, "packed sequences / attention bias / softmax offset")
        if module.attention_dropout.p and module.training:
            _refuse(module, f"attention dropout {module.attention_dropout.p}")
        seq_q, batch, seq_k = query.shape[0], query.shape[1], key.shape[0]
        if attention_mask is None:
            visible = torch.ones(seq_q, seq_k, dtype=torch.bool, device=query.device).tril(seq_k - seq_q)[None, None]
        elif attention_mask.dtype == torch.bool:
            visible = ~attention_mask  # megatron: True masks a key out
        else:
            _refuse(module, f"a {attention_mask.dtype} attention mask")
        visible = visible.expand(batch, 1, seq_q, seq_k)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [S, B, H, D] -> [B, H, S, D]
        out = fn(q, k, v, visible, float(module.softmax_scale))  # [B, S, H, D]
        return out.transpose(0, 1).reshape(seq_q, batch, -1)

    return module._skyrl_dispatch.call("attention", module, stock, installed)


def _mlp_forward(module, hidden_states, per_token_scale=None, **kwargs):
    dispatch = module._skyrl_dispatch
    fn = dispatch.resolve("silu_mul", module)
    if fn is None:
        return module._skyrl_stock_forward(hidden_states, per_token_scale=per_token_scale, **kwargs)
    if per_token_scale is not None:
        _refuse(module, "per-token scales (MoE experts)")
    intermediate, bias = module.linear_fc1(hidden_states)
    if bias is not None:
        intermediate = intermediate + bias
    gate, up = torch.chunk(intermediate, 2, dim=-1)
    hidden = fn(gate, up)
    dispatch.emit("silu_mul", module, hidden)
    return module.linear_fc2(hidden)


def _is_swiglu_mlp(module: Any) -> bool:
    config = module.config
    return (
        config.gated_linear_unit
        and config.activation_func is torch.nn.functional.silu
        and not config.use_te_activation_func
        and getattr(config, "activation_func_clamp_value", None) is None
        and not getattr(config, "glu_linear_offset", 0.0)
    )


def _gated_delta_net_class() -> type | None:
    try:
        from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    except ImportError:  # a megatron-core without it builds no hybrid either
        return None
    return GatedDeltaNet


def _claim_shared_expert(record: PatchRecord, qualname: str, moe: Any) -> None:
    """The shared expert's linears (the MoE forward calls them on the op path; its stock forward
    calls them too), recorded as computing ``silu_mul`` and ``linear``."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    shared = moe.shared_experts
    if shared is None:
        return
    name = f"{qualname}.shared_experts"
    for leaf, cls, forward in (("linear_fc1", ColumnParallelLinear, _column_forward), ("linear_fc2", RowParallelLinear, _row_forward)):
        linear = getattr(shared, leaf)
        if type(linear) is not cls:
            record.refuse(f"{name}.{leaf}", type(linear).__name__)
            continue
        if cls is ColumnParallelLinear:
            linear._skyrl_columns = _column_layout(f"{name}.{leaf}", linear, None)
        record.claim(linear, f"{name}.{leaf}", "linear", forward)
    record.claim(shared, name, "silu_mul")  # computed by the MoE forward (moe_sites._shared_expert)


# --- the patcher -----------------------------------------------------------------------------------


def patch_megatron_model(model: Any, ledger: OpLedger, *, vocab_size: int | None = None) -> None:
    """Route every op of a megatron-core ``GPTModel`` (local layer spec) through ``OpDispatch``;
    idempotent. ``vocab_size``: the real vocabulary (``output_layer`` rows beyond it are padding).

    Records in ``ledger.meta`` what ``PatchRecord`` records: ``op_modules``, ``unpatched`` (modules
    that compute an op but have no mapping here, their submodules not examined), ``patched_modules``.
    """
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from skyrl_megatron.hybrid import UnitOffsetRMSNorm

    GatedDeltaNet = _gated_delta_net_class()

    dispatch = attach_dispatch(model, ledger)
    if dispatch is None:
        return
    record = PatchRecord(dispatch)
    skipped: list[str] = []  # modules whose submodules are not examined

    def inside(qualname: str) -> bool:
        return any(qualname.startswith(prefix + ".") for prefix in skipped)

    for qualname, module in model.named_modules():
        if inside(qualname):
            continue
        cls = type(module)
        name = cls.__name__
        if cls is VocabParallelEmbedding:
            record.claim(module, qualname, "embedding", _embedding_forward)
        elif cls is ColumnParallelLinear:
            module._skyrl_columns = _column_layout(qualname, module, vocab_size)
            record.claim(module, qualname, "linear", _column_forward)
        elif cls is RowParallelLinear:
            record.claim(module, qualname, "linear", _row_forward)
        elif cls is torch.nn.RMSNorm or cls is UnitOffsetRMSNorm:
            module._skyrl_unit_offset = cls is UnitOffsetRMSNorm
            record.claim(module, qualname, "rms_norm", _rms_norm_forward)
        elif cls is GatedDeltaNet:
            # Its in_proj, out_norm and out_proj are claimed on their own (linear, rms_norm).
            record.claim(module, qualname, "gdn_core", gdn_forward, also=("gdn_conv",))
        elif cls is RotaryEmbedding and not module.rotary_interleaved:
            record.claim(module, qualname, "rope", _rope_forward)
        elif cls is DotProductAttention:
            record.claim(module, qualname, "attention", _attention_forward)
            skipped.append(qualname)  # its softmax and dropout are inside the op
        elif cls is MLP and _is_swiglu_mlp(module):
            record.claim(module, qualname, "silu_mul", _mlp_forward)
        elif cls is MoELayer and check_moe_layer(module) is None:
            record.claim(module, qualname, "moe_router", moe_layer_forward, also=("moe_experts", "moe_combine"))
            _claim_shared_expert(record, qualname, module)
            skipped.append(qualname)  # router, dispatcher and experts are inside the ops
        elif name not in _CONTAINERS and name.endswith(_COMPUTING_SUFFIXES):
            record.refuse(qualname, name)
            skipped.append(qualname)
    _install_rotary_application()
    record.finish(ledger)
