"""Weight conversion between Hugging Face names/layouts and Megatron's tensor-parallel shards.

Megatron stores, per tensor-parallel rank ``r`` of ``tp``:

- ``linear_qkv``: for each of its ``kv_heads / tp`` query groups, the group's query heads, then its
  key head, then its value head, stacked on rows (``[groups * (q_per_group + 2) * head_dim, hidden]``);
- ``linear_fc1``: rank ``r``'s rows of ``gate_proj`` stacked on rank ``r``'s rows of ``up_proj``
  (SwiGLU splits its output in halves: ``silu(first) * second``);
- column-parallel weights (``linear_qkv``, ``linear_fc1``, word embeddings, ``output_layer``) split
  on rows, row-parallel ones (``linear_proj``, ``linear_fc2``) on columns; norms replicated;
- word embeddings and ``output_layer`` padded with zero rows to a vocabulary divisible by ``tp``.

Both directions only slice, stack and reshape, so HF -> Megatron -> HF is bit-exact.
``fused_norms`` selects the Transformer Engine layer spec's names, where the input and pre-MLP norms
live inside ``linear_qkv`` / ``linear_fc1`` as ``layer_norm_weight``.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from skyrl_megatron.columns import ColumnLayout
from skyrl_megatron.layout import GPTLayout


def _norm_names(fused_norms: bool) -> tuple[str, str]:
    if fused_norms:
        return "self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"
    return "input_layernorm.weight", "pre_mlp_layernorm.weight"


def _rows(t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    return t.chunk(tp, dim=0)[rank]


def _cols(t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    return t.chunk(tp, dim=1)[rank]


def _pad_vocab(t: torch.Tensor, padded: int) -> torch.Tensor:
    if t.shape[0] == padded:
        return t
    return torch.cat([t, t.new_zeros(padded - t.shape[0], *t.shape[1:])])


def _gate_then_up(shards: Sequence[Mapping[str, torch.Tensor]], name: str) -> torch.Tensor:
    """The full ``[gate; up]`` rows of a SwiGLU ``linear_fc1`` whose shards each hold ``[gate_r; up_r]``."""
    halves = [s[name].chunk(2, dim=0) for s in shards]
    return torch.cat([g for g, _ in halves] + [u for _, u in halves])


def expert_name(name: str, index: int) -> str:
    """``name`` (a parameter of ``local_experts.<i>``) renamed to expert ``index``."""
    head, _, rest = name.partition(".local_experts.")
    return f"{head}.local_experts.{index}.{rest.split('.', 1)[1]}"


def hf_to_megatron(
    hf: Mapping[str, torch.Tensor],
    layout: GPTLayout,
    *,
    tp_rank: int,
    tp_size: int,
    ep_rank: int = 0,
    ep_size: int = 1,
    fused_norms: bool = False,
) -> dict[str, torch.Tensor]:
    """The Megatron parameters (names as in ``GPTModel.named_parameters``) of tensor-parallel rank
    ``tp_rank`` and expert-parallel rank ``ep_rank`` (which holds experts ``ep_rank * E / ep_size``
    onwards, numbered from 0 locally) from a full Hugging Face state dict."""
    layout.check_tensor_parallel(tp_size)
    if layout.num_experts % ep_size:
        raise ValueError(f"expert_parallel={ep_size} does not divide the model's num_experts ({layout.num_experts})")
    r, tp = tp_rank, tp_size
    hd, qpg, groups = layout.head_dim, layout.heads_per_group, layout.num_kv_heads
    padded = layout.padded_vocab_size(tp)
    in_norm, mlp_norm = _norm_names(fused_norms)
    out: dict[str, torch.Tensor] = {
        "embedding.word_embeddings.weight": _rows(_pad_vocab(hf["model.embed_tokens.weight"], padded), r, tp)
    }
    for i in range(layout.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[dst + in_norm] = hf[src + "input_layernorm.weight"]
        if layout.is_linear_layer(i):
            out.update(_gdn_to_megatron(hf, src + "linear_attn.", dst + "self_attention.", layout, r, tp))
        elif layout.attention_output_gate:
            qkv = ColumnLayout.fused_qkv(groups, qpg, hd, output_gate=True).to_megatron(
                [hf[src + f"self_attn.{p}_proj.weight"] for p in "qkv"], tp
            )[r]
            out[dst + "self_attention.linear_qkv.weight"] = qkv
        else:
            q = hf[src + "self_attn.q_proj.weight"].reshape(groups, qpg * hd, -1)
            k = hf[src + "self_attn.k_proj.weight"].reshape(groups, hd, -1)
            v = hf[src + "self_attn.v_proj.weight"].reshape(groups, hd, -1)
            qkv = torch.cat([q, k, v], dim=1)  # [groups, (qpg + 2) * hd, hidden]
            out[dst + "self_attention.linear_qkv.weight"] = _rows(qkv, r, tp).reshape(-1, qkv.shape[-1])
        if not layout.is_linear_layer(i):
            if layout.qk_norm:
                out[dst + "self_attention.q_layernorm.weight"] = hf[src + "self_attn.q_norm.weight"]
                out[dst + "self_attention.k_layernorm.weight"] = hf[src + "self_attn.k_norm.weight"]
            out[dst + "self_attention.linear_proj.weight"] = _cols(hf[src + "self_attn.o_proj.weight"], r, tp)
        out[dst + mlp_norm] = hf[src + "post_attention_layernorm.weight"]
        if layout.is_moe_layer(i):
            out[dst + "mlp.router.weight"] = hf[src + "mlp.gate.weight"]
            gate_up, down = hf[src + "mlp.experts.gate_up_proj"], hf[src + "mlp.experts.down_proj"]
            f = layout.moe_ffn_hidden_size
            local_experts = layout.num_experts // ep_size
            for local in range(local_experts):
                e = ep_rank * local_experts + local
                expert = f"{dst}mlp.experts.local_experts.{local}."
                out[expert + "linear_fc1.weight"] = torch.cat([_rows(gate_up[e, :f], r, tp), _rows(gate_up[e, f:], r, tp)])
                out[expert + "linear_fc2.weight"] = _cols(down[e], r, tp)
            if layout.shared_expert_ffn_hidden_size:
                out.update(_swiglu_to_megatron(hf, src + "mlp.shared_expert.", dst + "mlp.shared_experts.", r, tp))
                out[dst + "mlp.shared_experts.gate_weight"] = hf[src + "mlp.shared_expert_gate.weight"]
        else:
            out.update(_swiglu_to_megatron(hf, src + "mlp.", dst + "mlp.", r, tp))
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if not layout.tied_embeddings:
        out["output_layer.weight"] = _rows(_pad_vocab(hf["lm_head.weight"], padded), r, tp)
    return {name: t.contiguous() for name, t in out.items()}


def megatron_to_hf(
    shards: Sequence[Mapping[str, torch.Tensor]], layout: GPTLayout, *, fused_norms: bool = False
) -> dict[str, torch.Tensor]:
    """The full Hugging Face state dict (transformers' names and order, ``lm_head.weight`` included
    even when tied) from every tensor-parallel rank's parameters, in rank order (with every expert,
    numbered globally: see ``expert_name``)."""
    tp = len(shards)
    hd, qpg = layout.head_dim, layout.heads_per_group
    V = layout.vocab_size
    in_norm, mlp_norm = _norm_names(fused_norms)

    def rows(name: str) -> torch.Tensor:
        return torch.cat([s[name] for s in shards], dim=0)

    def cols(name: str) -> torch.Tensor:
        return torch.cat([s[name] for s in shards], dim=1)

    first = shards[0]
    embed = rows("embedding.word_embeddings.weight")[:V]
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": embed}
    for i in range(layout.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        if layout.is_linear_layer(i):
            out.update(_gdn_to_hf(shards, src + "self_attention.", dst + "linear_attn.", layout))
        elif layout.attention_output_gate:
            columns = ColumnLayout.fused_qkv(layout.num_kv_heads, qpg, hd, output_gate=True)
            q, k, v = columns.to_hf([s[src + "self_attention.linear_qkv.weight"] for s in shards])
            out[dst + "self_attn.q_proj.weight"], out[dst + "self_attn.k_proj.weight"], out[dst + "self_attn.v_proj.weight"] = q, k, v
        else:
            qkv = rows(src + "self_attention.linear_qkv.weight")
            qkv = qkv.reshape(layout.num_kv_heads, (qpg + 2) * hd, -1)
            q, k, v = qkv.split([qpg * hd, hd, hd], dim=1)
            hidden = qkv.shape[-1]
            out[dst + "self_attn.q_proj.weight"] = q.reshape(-1, hidden)
            out[dst + "self_attn.k_proj.weight"] = k.reshape(-1, hidden)
            out[dst + "self_attn.v_proj.weight"] = v.reshape(-1, hidden)
        if not layout.is_linear_layer(i):
            out[dst + "self_attn.o_proj.weight"] = cols(src + "self_attention.linear_proj.weight")
            if layout.qk_norm:
                out[dst + "self_attn.q_norm.weight"] = first[src + "self_attention.q_layernorm.weight"]
                out[dst + "self_attn.k_norm.weight"] = first[src + "self_attention.k_layernorm.weight"]
        if layout.is_moe_layer(i):
            experts = [f"{src}mlp.experts.local_experts.{e}." for e in range(layout.num_experts)]
            if layout.model_type == "qwen3_next":  # transformers' order: its router before its experts
                out[dst + "mlp.gate.weight"] = first[src + "mlp.router.weight"]
            out[dst + "mlp.experts.gate_up_proj"] = torch.stack([_gate_then_up(shards, e + "linear_fc1.weight") for e in experts])
            out[dst + "mlp.experts.down_proj"] = torch.stack([cols(e + "linear_fc2.weight") for e in experts])
            out.setdefault(dst + "mlp.gate.weight", first[src + "mlp.router.weight"])
            if layout.shared_expert_ffn_hidden_size:
                out.update(_swiglu_to_hf(shards, src + "mlp.shared_experts.", dst + "mlp.shared_expert."))
                out[dst + "mlp.shared_expert_gate.weight"] = first[src + "mlp.shared_experts.gate_weight"]
        else:
            out.update(_swiglu_to_hf(shards, src + "mlp.", dst + "mlp."))
        out[dst + "input_layernorm.weight"] = first[src + in_norm]
        out[dst + "post_attention_layernorm.weight"] = first[src + mlp_norm]
    out["model.norm.weight"] = first["decoder.final_layernorm.weight"]
    out["lm_head.weight"] = embed if layout.tied_embeddings else rows("output_layer.weight")[:V]
    return {name: t.contiguous() for name, t in out.items()}


def _swiglu_to_megatron(hf: Mapping[str, torch.Tensor], src: str, dst: str, r: int, tp: int) -> dict[str, torch.Tensor]:
    gate, up = _rows(hf[src + "gate_proj.weight"], r, tp), _rows(hf[src + "up_proj.weight"], r, tp)
    return {dst + "linear_fc1.weight": torch.cat([gate, up]), dst + "linear_fc2.weight": _cols(hf[src + "down_proj.weight"], r, tp)}


def _swiglu_to_hf(shards: Sequence[Mapping[str, torch.Tensor]], src: str, dst: str) -> dict[str, torch.Tensor]:
    gate, up = _gate_then_up(shards, src + "linear_fc1.weight").chunk(2, dim=0)
    down = torch.cat([s[src + "linear_fc2.weight"] for s in shards], dim=1)
    return {dst + "gate_proj.weight": gate, dst + "up_proj.weight": up, dst + "down_proj.weight": down}


def _gdn_columns(layout: GPTLayout, tp: int) -> tuple[ColumnLayout, ColumnLayout]:
    sizes = (layout.linear_num_key_heads, layout.linear_num_value_heads, layout.linear_key_head_dim, layout.linear_value_head_dim, tp)
    return ColumnLayout.gdn_in_proj(*sizes), ColumnLayout.gdn_conv(*sizes)


def _gdn_to_megatron(hf: Mapping[str, torch.Tensor], src: str, dst: str, layout: GPTLayout, r: int, tp: int) -> dict[str, torch.Tensor]:
    """GatedDeltaNet: ``in_proj`` = rank's ``[q, k, v, z, b, a]`` (``columns.ColumnLayout.gdn_in_proj``),
    conv channels ``[q, k, v]`` of the rank's heads, ``A_log`` / ``dt_bias`` of its value heads,
    ``out_proj`` split on columns, the output norm replicated."""
    in_proj, conv = _gdn_columns(layout, tp)
    return {
        dst + "in_proj.weight": in_proj.to_megatron([hf[src + "in_proj_qkvz.weight"], hf[src + "in_proj_ba.weight"]], tp)[r],
        dst + "conv1d.weight": conv.to_megatron(list(hf[src + "conv1d.weight"].split(conv.sizes)), tp)[r],
        dst + "A_log": _rows(hf[src + "A_log"], r, tp),
        dst + "dt_bias": _rows(hf[src + "dt_bias"], r, tp),
        dst + "out_norm.weight": hf[src + "norm.weight"],
        dst + "out_proj.weight": _cols(hf[src + "out_proj.weight"], r, tp),
    }


def _gdn_to_hf(shards: Sequence[Mapping[str, torch.Tensor]], src: str, dst: str, layout: GPTLayout) -> dict[str, torch.Tensor]:
    in_proj, conv = _gdn_columns(layout, len(shards))
    qkvz, ba = in_proj.to_hf([s[src + "in_proj.weight"] for s in shards])
    return {
        dst + "dt_bias": torch.cat([s[src + "dt_bias"] for s in shards]),
        dst + "A_log": torch.cat([s[src + "A_log"] for s in shards]),
        dst + "conv1d.weight": torch.cat(conv.to_hf([s[src + "conv1d.weight"] for s in shards])),
        dst + "in_proj_qkvz.weight": qkvz,
        dst + "in_proj_ba.weight": ba,
        dst + "norm.weight": shards[0][src + "out_norm.weight"],
        dst + "out_proj.weight": torch.cat([s[src + "out_proj.weight"] for s in shards], dim=1),
    }
