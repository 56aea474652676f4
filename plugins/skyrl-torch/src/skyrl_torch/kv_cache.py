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

Hybrid decoders (Qwen3-Next: GatedDeltaNet linear-attention layers between attention layers) keep,
per slot and linear-attention layer, the causal conv's last inputs (``[slots, channels, width]``,
model dtype) and the delta rule's recurrent state (``[slots, heads, key_dim, value_dim]``, fp32).
The layers reach them through transformers' linear-attention cache API (``has_previous_state``,
``layers[i].conv_states`` / ``recurrent_states``, ``update_conv_state``, ``update_recurrent_state``),
which reads and writes the planned rows' slots. ``plan(..., fresh=True)`` (a prefill from position
0) makes every row start from zero state, whatever its slot held before; otherwise rows continue
from their slot's state. ``copy_prefix`` copies a slot's state along with its keys/values: a state
summarises the whole sequence so far, so it is only copied at the end of what the source computed.

``KVBudget`` says, from the model's config, how many bytes a cache of a given shape takes (what
``nbytes`` is once every layer has written) and the most the engine lets it take.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from transformers.cache_utils import Cache

# Slot capacities are rounded up to a multiple of this many positions (fewer reallocations as the
# lengths of the requests in flight vary).
CAPACITY_STEP = 64


def slot_capacity(length: int) -> int:
    """The capacity the engine gives slots for sequences of up to ``length`` tokens."""
    return -(-length // CAPACITY_STEP) * CAPACITY_STEP


@attrs.frozen
class KVBudget:
    """The bytes of a model's ``SlotKVCache`` by shape, and the most it may take (``limit``: the
    engine option ``kv_cache_memory_bytes``)."""

    per_position: int  # one cached position of a slot: every full-attention layer's keys and values
    per_slot: int  # a slot whatever its length: every linear-attention layer's conv and recurrent state
    limit: int

    @classmethod
    def of(cls, config: Any, dtype: torch.dtype, limit: int) -> KVBudget:
        """From a transformers text config, the shapes ``SlotKVCache`` allocates for its layers."""
        linear = sum(1 for t in getattr(config, "layer_types", None) or () if t == "linear_attention")
        attention = config.num_hidden_layers - linear
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        per_slot = 0
        # GatedDeltaNet: conv inputs [q+k+v channels, width] in the model dtype, recurrent state
        # [v heads, k dim, v dim] in fp32
        if linear:
            channels = 2 * config.linear_num_key_heads * config.linear_key_head_dim
            channels += config.linear_num_value_heads * config.linear_value_head_dim
            conv = channels * config.linear_conv_kernel_dim * dtype.itemsize
            recurrent = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
            per_slot = linear * (conv + recurrent)
        return cls(per_position=attention * 2 * kv_heads * head_dim * dtype.itemsize, per_slot=per_slot, limit=limit)

    def cache_bytes(self, num_slots: int, capacity: int) -> int:
        # capacity + 1: the scratch column padding writes to
        return num_slots * (self.per_slot + self.per_position * (capacity + 1))

    def fits(self, num_slots: int, capacity: int) -> bool:
        return self.cache_bytes(num_slots, capacity) <= self.limit

    def refusal(self, length: int) -> str | None:
        """Why one sample of ``length`` tokens (prompt + max_tokens) cannot run even alone; None if it can."""
        needed = self.cache_bytes(1, slot_capacity(length))
        if needed <= self.limit:
            return None
        return (f"one sample of {length} tokens (prompt + max_tokens) needs {needed} bytes of KV cache, "
                f"more than kv_cache_memory_bytes ({self.limit})")


class SlotKVCache(Cache):
    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
        linear_layers: tuple[int, ...] = (),
    ) -> None:
        super().__init__(layers=[])
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        # Linear-attention layers: per-slot conv inputs and recurrent state (allocated at first write).
        self.linear_layers = tuple(linear_layers)
        self.conv: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}
        if self.linear_layers:  # (dense models keep transformers' empty layer list)
            self.layers = [_SlotStateLayer(self, i) if i in self.linear_layers else None for i in range(num_layers)]
        self._fresh = False
        self.num_slots = num_slots
        self.capacity = capacity
        self.dtype = dtype
        self.device = torch.device(device)
        self._rows: torch.Tensor | None = None  # [n] slot of each row
        self._contiguous_rows = 0  # > 0: rows are slots 0..n-1 (read a view, no gather)
        self._write_pos: torch.Tensor | None = None  # [n, q]
        self._kv_len = 0

    # -- what the engine calls ------------------------------------------------------------------

    def plan(
        self, rows: torch.Tensor, positions: torch.Tensor, *, contiguous: bool = False, fresh: bool = False
    ) -> torch.Tensor:
        """Prepare a forward of ``positions.shape`` tokens for slots ``rows``; return its 4D additive mask.

        ``positions[i, t]`` is the position of token ``t`` of row ``i`` (``-1`` for padding). A real
        token sees every key of its own slot at a position ``<=`` its own; a padding token sees key 0
        only (its output is discarded; this keeps softmax finite). ``contiguous`` promises that
        ``rows`` is ``0..n-1``, so attention reads a view of the cache instead of a gathered copy.
        ``fresh``: every row starts its sequence here (position 0), so linear-attention layers start
        from zero state instead of their slot's.
        """
        kv_len = int(positions.max()) + 1
        if kv_len > self.capacity:
            raise ValueError(f"position {kv_len - 1} does not fit a KV cache of {self.capacity} tokens")
        self._rows = rows
        self._contiguous_rows = int(rows.shape[0]) if contiguous else 0
        self._write_pos = torch.where(positions >= 0, positions, self.capacity)
        self._kv_len = kv_len
        self._fresh = fresh
        for layer in self.layers:
            if layer is not None:
                layer.handed_out = None
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
        for state in (*self.conv.values(), *self.recurrent.values()):
            state[dst] = state[src_slot].clone()

    # -- what attention layers call ------------------------------------------------------------

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """transformers' attention layers call this with ``[n, kv_heads, q, head_dim]`` keys/values."""
        return self.write_and_read(layer_idx, key_states.transpose(1, 2), value_states.transpose(1, 2))

    def write_and_read(self, layer_idx: int, keys_new: torch.Tensor, values_new: torch.Tensor, *, read_multiple: int = 1):
        """Write this forward's keys/values (``[n, q, kv_heads, head_dim]``) at the planned positions;
        return the rows' cached keys/values ``[n, kv_heads, length, head_dim]``, ``length`` being the
        longest visible length rounded up to ``read_multiple`` (at most ``capacity``). Keys past the
        visible length are whatever the slot holds: finite, and hidden by the mask."""
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if keys is None:
            keys = self.keys[layer_idx] = self._allocate(keys_new)
            values = self.values[layer_idx] = self._allocate(values_new)
        rows = self._rows.unsqueeze(1)  # [n, 1] broadcasts against positions [n, q]
        # Indexing [rows, :, pos] puts the advanced dims first: [n, q, kv_heads, head_dim].
        keys[rows, :, self._write_pos] = keys_new.to(keys.dtype)
        values[rows, :, self._write_pos] = values_new.to(values.dtype)
        length = min(-(-self._kv_len // read_multiple) * read_multiple, self.capacity)
        if self._contiguous_rows:
            n = self._contiguous_rows
            return keys[:n, :, :length], values[:n, :, :length]
        return keys[self._rows, :, :length], values[self._rows, :, :length]

    # -- what linear-attention layers call (transformers' linear-attention cache API) ----------

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return not self._fresh

    def update_conv_state(
        self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, conv_kernel_size: int | None = None, **kwargs
    ) -> torch.Tensor:
        """Append this forward's conv inputs ``[n, channels, q]`` to the rows' history; keep the
        last ``conv_kernel_size`` per slot; return the history plus the new inputs (what the
        layer convolves, as transformers' ``LinearAttentionLayer`` returns it)."""
        stored = self.conv.get(layer_idx)
        width = conv_kernel_size or (stored.shape[-1] if stored is not None else conv_states.shape[-1])
        if stored is None:
            stored = self.conv[layer_idx] = torch.zeros(
                (self.num_slots, conv_states.shape[1], width), dtype=conv_states.dtype, device=self.device
            )
        if self._fresh:
            full = conv_states
            if full.shape[-1] < width:
                full = torch.nn.functional.pad(full, (width - full.shape[-1], 0))
        else:
            full = torch.cat((self._read(stored), conv_states.to(stored.dtype)), dim=-1)
        stored[self._rows] = full[..., -width:].to(stored.dtype)
        self.layers[layer_idx].handed_out = None  # superseded
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs) -> torch.Tensor:
        stored = self.recurrent.get(layer_idx)
        if stored is None:
            stored = self.recurrent[layer_idx] = torch.zeros(
                (self.num_slots, *recurrent_states.shape[1:]), dtype=torch.float32, device=self.device
            )
        stored[self._rows] = recurrent_states.to(stored.dtype)
        layer = self.layers[layer_idx]
        if layer.handed_out is not None:
            # transformers' one-token decode updates the conv history it read in place; when that
            # was a gathered copy (rows not 0..n-1), write it back.
            self.conv[layer_idx][self._rows] = layer.handed_out
            layer.handed_out = None
        return recurrent_states

    def resized(self, num_slots: int, capacity: int) -> SlotKVCache:
        """A cache of this shape holding the keys/values (up to ``capacity``) and states of slots
        ``0..num_slots - 1`` where they are, so samples in flight there continue in it: an engine
        admitting more or longer requests mid-run grows it; one within a memory budget may shrink
        it, once its samples fit those slots and that capacity.

        This cache is consumed: each of its tensors is dropped once copied, so the memory held at
        once is one cache plus one layer's tensor, never two whole caches (a resize within a budget
        would otherwise briefly take twice it). Use only the returned cache afterwards."""
        new = SlotKVCache(num_layers=len(self.keys), num_slots=num_slots, capacity=capacity, dtype=self.dtype,
                          device=self.device, linear_layers=self.linear_layers)
        slots, kept = min(num_slots, self.num_slots), min(capacity, self.capacity)
        for old_layers, new_layers in ((self.keys, new.keys), (self.values, new.values)):
            for i, t in enumerate(old_layers):
                if t is not None:
                    old_layers[i] = None
                    resized = torch.zeros((num_slots, t.shape[1], capacity + 1, t.shape[3]), dtype=t.dtype, device=t.device)
                    resized[:slots, :, :kept] = t[:slots, :, :kept]
                    new_layers[i] = resized
                    del t  # (the loop's last reference to the old layer)
        for old_states, new_states in ((self.conv, new.conv), (self.recurrent, new.recurrent)):
            for i in list(old_states):
                t = old_states.pop(i)
                resized = torch.zeros((num_slots, *t.shape[1:]), dtype=t.dtype, device=t.device)
                resized[:slots] = t[:slots]
                new_states[i] = resized
                del t
        return new

    def _read(self, stored: torch.Tensor) -> torch.Tensor:
        """The rows' part of a per-slot state: a view for contiguous rows, else a gathered copy."""
        if self._contiguous_rows:
            return stored[: self._contiguous_rows]
        return stored[self._rows]

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
        tensors = (*self.keys, *self.values, *self.conv.values(), *self.recurrent.values())
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class _SlotStateLayer:
    """``cache.layers[i]`` of a linear-attention layer: its rows' states, as transformers reads them."""

    record_past = False  # no rollback recording

    def __init__(self, cache: SlotKVCache, layer_idx: int) -> None:
        self.cache = cache
        self.layer_idx = layer_idx
        self.handed_out: torch.Tensor | None = None  # a gathered conv history the layer may update in place

    @property
    def conv_states(self) -> dict[int, torch.Tensor]:
        stored = self.cache.conv.get(self.layer_idx)
        if stored is None or self.cache._fresh:
            raise RuntimeError(f"layer {self.layer_idx}: no previous conv state to read (a fresh prefill)")
        rows = self.cache._read(stored)
        self.handed_out = None if self.cache._contiguous_rows else rows
        return {0: rows}

    @property
    def recurrent_states(self) -> dict[int, torch.Tensor]:
        stored = self.cache.recurrent.get(self.layer_idx)
        if stored is None or self.cache._fresh:
            raise RuntimeError(f"layer {self.layer_idx}: no previous recurrent state to read (a fresh prefill)")
        return {0: self.cache._read(stored)}
