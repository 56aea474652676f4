"""A preallocated KV cache with one slot per sequence, usable as a transformers ``Cache``.

Each layer keeps ``keys``/``values`` of shape ``[slots, kv_heads, capacity + 1, head_dim]``,
allocated (zeroed) at the layer's first write, so heads and head sizes come from the model itself. A slot
holds one sequence from cache index 0, so the cache index of a token *is* its position: no left
padding ever reaches attention, and sequences of different lengths decode side by side.

Before each forward the engine calls ``plan`` with the slots the rows belong to and the position
of every input token (``-1`` for padding). The model's attention layers then call ``update``,
which writes the new keys/values in place at those positions and returns the slots' keys/values
up to the longest visible length; ``attention_mask`` (built by ``plan``) hides every key a row
must not see. Padding writes land in a scratch column past ``capacity`` that is never visible.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache


class SlotKVCache(Cache):
    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__(layers=[])
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.num_slots = num_slots
        self.capacity = capacity
        self.dtype = dtype
        self.device = torch.device(device)
        self._rows: torch.Tensor | None = None  # [n] slot of each row
        self._contiguous_rows = 0  # > 0: rows are slots 0..n-1 (read a view, no gather)
        self._write_pos: torch.Tensor | None = None  # [n, q]
        self._kv_len = 0

    # -- what the engine calls ------------------------------------------------------------------

    def plan(self, rows: torch.Tensor, positions: torch.Tensor, *, contiguous: bool = False) -> torch.Tensor:
        """Prepare a forward of ``positions.shape`` tokens for slots ``rows``; return its 4D additive mask.

        ``positions[i, t]`` is the position of token ``t`` of row ``i`` (``-1`` for padding). A real
        token sees every key of its own slot at a position ``<=`` its own; a padding token sees key 0
        only (its output is discarded; this keeps softmax finite). ``contiguous`` promises that
        ``rows`` is ``0..n-1``, so attention reads a view of the cache instead of a gathered copy.
        """
        kv_len = int(positions.max()) + 1
        if kv_len > self.capacity:
            raise ValueError(f"position {kv_len - 1} does not fit a KV cache of {self.capacity} tokens")
        self._rows = rows
        self._contiguous_rows = int(rows.shape[0]) if contiguous else 0
        self._write_pos = torch.where(positions >= 0, positions, self.capacity)
        self._kv_len = kv_len
        key_pos = torch.arange(kv_len, device=positions.device)
        visible = key_pos.view(1, 1, -1) <= positions.clamp(min=0).unsqueeze(-1)  # [n, q, kv]
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=positions.device)
        mask.masked_fill_(~visible, torch.finfo(self.dtype).min)
        return mask.unsqueeze(1)

    def copy_prefix(self, src_slot: int, dst_slots: list[int], length: int) -> None:
        """Give ``dst_slots`` the first ``length`` cached tokens of ``src_slot`` (shared prefill)."""
        if not dst_slots or length == 0:
            return
        dst = torch.tensor(dst_slots, device=self.device)
        for cache in (*self.keys, *self.values):
            if cache is not None:
                cache[dst, :, :length] = cache[src_slot, :, :length]

    # -- what attention layers call ------------------------------------------------------------

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """transformers' attention layers call this with ``[n, kv_heads, q, head_dim]`` keys/values."""
        return self.write_and_read(layer_idx, key_states.transpose(1, 2), value_states.transpose(1, 2))

    def write_and_read(self, layer_idx: int, keys_new: torch.Tensor, values_new: torch.Tensor):
        """Write this forward's keys/values (``[n, q, kv_heads, head_dim]``) at the planned positions;
        return the rows' cached keys/values ``[n, kv_heads, visible length, head_dim]``."""
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if keys is None:
            keys = self.keys[layer_idx] = self._allocate(keys_new)
            values = self.values[layer_idx] = self._allocate(values_new)
        rows = self._rows.unsqueeze(1)  # [n, 1] broadcasts against positions [n, q]
        # Indexing [rows, :, pos] puts the advanced dims first: [n, q, kv_heads, head_dim].
        keys[rows, :, self._write_pos] = keys_new.to(keys.dtype)
        values[rows, :, self._write_pos] = values_new.to(values.dtype)
        if self._contiguous_rows:
            n = self._contiguous_rows
            return keys[:n, :, : self._kv_len], values[:n, :, : self._kv_len]
        return keys[self._rows, :, : self._kv_len], values[self._rows, :, : self._kv_len]

    def _allocate(self, like: torch.Tensor) -> torch.Tensor:
        # Zeros, not empty: masked keys still enter the score product, and garbage could be NaN.
        # +1 column: the scratch position padding writes to.
        shape = (self.num_slots, like.shape[2], self.capacity + 1, like.shape[3])
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.capacity

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values) if t is not None)
