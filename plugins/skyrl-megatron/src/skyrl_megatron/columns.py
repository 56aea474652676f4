"""Where the transformers projections sit in a Megatron column-parallel weight.

A column-parallel weight gathered over its ``tp`` ranks (rank order) stacks the rows of several
transformers projections in Megatron's order (fused q/k/v per query group, ``[gate_r; up_r]`` per
rank, GatedDeltaNet's ``[q_r, k_r, v_r, z_r, b_r, a_r]`` per rank). ``ColumnLayout`` is that
permutation; weight conversion (``convert``) and the op sites (``ops_sites``) both read it, so the
two agree by construction.
"""

from __future__ import annotations

import torch


class ColumnLayout:
    """``hf_rows`` lists gathered row indices in transformers order (projection after projection),
    ``sizes`` the projections' row counts. Gathered rows absent from ``hf_rows`` (vocabulary padding)
    give 0."""

    def __init__(self, hf_rows: torch.Tensor, sizes: list[int], gathered_rows: int) -> None:
        self.hf_rows, self.sizes = hf_rows, sizes
        position = torch.full((gathered_rows,), len(hf_rows), dtype=torch.long)  # -> the zero column
        position[hf_rows] = torch.arange(len(hf_rows))
        self.position = position

    @classmethod
    def plain(cls, rows: int, real: int | None = None) -> ColumnLayout:
        real = rows if real is None else real
        return cls(torch.arange(real), [real], rows)

    @classmethod
    def fused_qkv(cls, groups: int, q_per_group: int, head_dim: int, *, output_gate: bool = False) -> ColumnLayout:
        """``linear_qkv``: per query group, its query heads, (with ``output_gate``: their gate heads,)
        key head, value head (all ranks' groups in rank order are the groups in order). With the
        gate, transformers' ``q_proj`` interleaves per head: query rows, then that head's gate rows."""
        q_rows = q_per_group * head_dim
        block = ((2 if output_gate else 1) * q_per_group + 2) * head_dim
        base = torch.arange(groups)[:, None] * block
        query = (base + torch.arange(q_rows)).reshape(-1, head_dim)  # [heads, D]
        kv_start = (2 if output_gate else 1) * q_rows
        k = (base + kv_start + torch.arange(head_dim)).reshape(-1)
        v = (base + kv_start + head_dim + torch.arange(head_dim)).reshape(-1)
        if output_gate:
            gate = (base + q_rows + torch.arange(q_rows)).reshape(-1, head_dim)
            q = torch.cat([query, gate], dim=1).reshape(-1)
        else:
            q = query.reshape(-1)
        return cls(torch.cat([q, k, v]), [len(q), len(k), len(v)], groups * block)

    @classmethod
    def gate_up(cls, ffn: int, tp: int) -> ColumnLayout:
        """SwiGLU ``linear_fc1``: rank ``r`` holds ``[gate_r; up_r]`` (``ffn / tp`` rows each)."""
        local = ffn // tp
        base = torch.arange(tp)[:, None] * 2 * local
        gate = (base + torch.arange(local)).reshape(-1)
        up = (base + local + torch.arange(local)).reshape(-1)
        return cls(torch.cat([gate, up]), [ffn, ffn], 2 * ffn)

    @classmethod
    def gdn_in_proj(cls, key_heads: int, value_heads: int, key_dim: int, value_dim: int, tp: int) -> ColumnLayout:
        """GatedDeltaNet's ``in_proj``: rank ``r`` holds ``[q_r, k_r, v_r, z_r, b_r, a_r]`` for its
        ``key_heads / tp`` key heads and their value heads. Transformers' projections:
        ``in_proj_qkvz`` (per key head: q, k, its value heads' v, their z) and ``in_proj_ba``
        (per key head: its value heads' b, then their a)."""
        hk, hv = key_heads // tp, value_heads // tp  # per rank
        group = value_heads // key_heads  # value heads per key head
        per_rank = 2 * hk * key_dim + 2 * hv * value_dim + 2 * hv
        offsets = {"q": 0, "k": hk * key_dim, "v": 2 * hk * key_dim, "z": 2 * hk * key_dim + hv * value_dim}
        offsets["b"] = 2 * hk * key_dim + 2 * hv * value_dim
        offsets["a"] = offsets["b"] + hv
        sizes = {"q": key_dim, "k": key_dim, "v": group * value_dim, "z": group * value_dim, "b": group, "a": group}
        qkvz, ba = [], []
        for head in range(key_heads):
            rank, local = divmod(head, hk)
            start = rank * per_rank
            for part, out in (("q", qkvz), ("k", qkvz), ("v", qkvz), ("z", qkvz), ("b", ba), ("a", ba)):
                out.append(start + offsets[part] + local * sizes[part] + torch.arange(sizes[part]))
        qkvz_rows, ba_rows = torch.cat(qkvz), torch.cat(ba)
        return cls(torch.cat([qkvz_rows, ba_rows]), [len(qkvz_rows), len(ba_rows)], tp * per_rank)

    @classmethod
    def gdn_conv(cls, key_heads: int, value_heads: int, key_dim: int, value_dim: int, tp: int) -> ColumnLayout:
        """GatedDeltaNet's conv channels: rank ``r`` holds ``[q_r, k_r, v_r]``; transformers' conv
        runs over ``[q, k, v]`` (all heads of each)."""
        qk, v = key_heads * key_dim // tp, value_heads * value_dim // tp
        per_rank = 2 * qk + v
        ranks = torch.arange(tp)[:, None] * per_rank
        parts = [(ranks + off + torch.arange(n)).reshape(-1) for off, n in ((0, qk), (qk, qk), (2 * qk, v))]
        return cls(torch.cat(parts), [len(p) for p in parts], tp * per_rank)

    def to_megatron(self, hf: list[torch.Tensor], tp: int) -> list[torch.Tensor]:
        """Each rank's rows from the transformers projections ``hf`` (in ``sizes`` order)."""
        stacked = torch.cat(hf)
        if stacked.shape[0] != len(self.hf_rows):
            raise ValueError(f"{stacked.shape[0]} transformers rows for a layout of {len(self.hf_rows)}")
        gathered = stacked.new_zeros(len(self.position), *stacked.shape[1:])
        gathered[self.hf_rows] = stacked
        return list(gathered.chunk(tp, dim=0))

    def to_hf(self, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        """The transformers projections from every rank's rows (rank order)."""
        return list(torch.cat(shards).index_select(0, self.hf_rows).split(self.sizes))
