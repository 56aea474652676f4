"""vLLM ``CustomOp`` replacements (registered out-of-tree under the class names they replace).

Each reproduces the trainer's transformers op boundaries and rounding points with the canonical
kernels (``skyrl_isoexec.kernels``), not vLLM's fused CPU kernels:

- ``RMSNorm(x, residual)``: vLLM fuses the residual add into the norm and normalises the fp32
  sum; transformers rounds ``residual + x`` to the model dtype first, then normalises. We round.
- ``RotaryEmbedding``: cos/sin from the one shared fp32 table of ``kernels.elementwise.rope``
  (indexed by position, cast to the model dtype), applied as transformers does:
  ``x * cos + rotate_half(x) * sin`` in the model dtype, on the first ``rotary_dim`` channels.
  Computed as ``x * cos + swap_halves(x) * [-sin1, sin2]``: ``(-a) * b`` and ``a * (-b)`` round
  alike, so the bits are transformers' with two fewer passes; the lookup is kept while the
  positions are those of the previous call (every layer of a step rotates at the same ones).
- ``SiluAndMul``: ``kernels.elementwise.silu_mul(gate, up)``.

A module built while IsoExec is off in this process keeps vLLM's own forward.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm, RMSNormGated
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

from skyrl_core.ops.rotary import default_inv_freq

from skyrl_isoexec.kernels import elementwise
from skyrl_isoexec.vllm import runtime


class IsoExecRMSNorm(runtime.DecidedAtBuild, RMSNorm):
    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if not self._isoexec:
            return super().forward(x, residual)
        if self.variance_size_override is not None:
            raise ValueError("IsoExec: RMSNorm over a partial hidden size (var_hidden_size) has no canonical op")
        runtime.observe("rms_norm", self)
        weight = self.weight if self.has_weight else torch.ones_like(self.weight)
        return _norm_after_residual(x, residual, weight, float(self.variance_epsilon), False)


def _norm_after_residual(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, unit_offset: bool):
    """vLLM's fused residual-add norm as the trainer computes it: ``residual + x`` rounded to the
    model dtype first (transformers' residual add), then the canonical norm; ``(normed, summed)``."""
    if residual is None:
        return elementwise.rms_norm(x, weight, eps, unit_offset)
    summed = residual + x
    return elementwise.rms_norm(summed, weight, eps, unit_offset), summed


class IsoExecGemmaRMSNorm(runtime.DecidedAtBuild, GemmaRMSNorm):
    """Qwen3-Next's norms (``x * (1 + weight)``): ``rms_norm`` with ``unit_offset``, residual add
    rounded first as in ``IsoExecRMSNorm``."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if not self._isoexec:
            return super().forward(x, residual)
        runtime.observe("rms_norm", self)
        return _norm_after_residual(x, residual, self.weight, float(self.variance_epsilon), True)


class IsoExecRMSNormGated(runtime.DecidedAtBuild, RMSNormGated):
    """GatedDeltaNet's output norm: ``rms_norm(x) * silu(z)`` (norm before gate, one group)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self._isoexec and (self.group_size not in (None, self.weight.shape[-1]) or not self.norm_before_gate
                              or self.activation not in ("silu", "swish")):
            raise ValueError(
                "IsoExec: only a single-group RMSNormGated with the norm before a SiLU gate has a canonical op "
                f"(got group_size={self.group_size}, norm_before_gate={self.norm_before_gate}, activation={self.activation!r})"
            )

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        if not self._isoexec:
            return super().forward(x, z)
        runtime.observe("rms_norm", self)
        return elementwise.rms_norm(x, self.weight, float(self.eps), False, z)


class IsoExecSiluAndMul(runtime.DecidedAtBuild, SiluAndMul):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._isoexec:
            return super().forward(x)
        runtime.observe("silu_mul", self)
        d = x.shape[-1] // 2
        return elementwise.silu_mul(x[..., :d], x[..., d:])


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], x[..., :half]), dim=-1)


class IsoExecRotaryEmbedding(runtime.DecidedAtBuild, RotaryEmbedding):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self._isoexec and not self.is_neox_style:
            raise ValueError(
                "IsoExec: interleaved (GPT-J style) rotary embeddings have no canonical op; "
                "the trainer's transformers models rotate halves (neox style)"
            )
        self._isoexec_inv_freq = default_inv_freq(self.base, self.rotary_dim)
        self._isoexec_last: tuple | None = None  # (positions, dtype, cos, signed sin)

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``[-sin1, sin2]`` for ``positions`` ``[T]``, ``[T, 1, rotary_dim]`` in ``dtype``."""
        last = self._isoexec_last
        if last is not None and last[1] == dtype and last[0].shape == positions.shape and torch.equal(last[0], positions):
            return last[2], last[3]
        cos, sin = elementwise.rope(self._isoexec_inv_freq, 1.0, positions, dtype)
        half = self.rotary_dim // 2
        signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        cos, signed = cos.unsqueeze(1), signed.unsqueeze(1)  # broadcast over heads
        self._isoexec_last = (positions.clone(), dtype, cos, signed)
        return cos, signed

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(cos.shape[0], -1, self.head_size)
        rot = x[..., : self.rotary_dim]
        rotated = (rot * cos).add_(_swap_halves(rot).mul_(signed_sin))
        if self.rotary_dim == self.head_size:
            return rotated.view(shape)
        return torch.cat((rotated, x[..., self.rotary_dim :]), dim=-1).reshape(shape)

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None):
        if not self._isoexec:
            return super().forward(positions, query, key)
        runtime.observe("rope", self)
        cos, signed_sin = self._cos_sin(positions.flatten(), query.dtype)
        return self._rotate(query, cos, signed_sin), None if key is None else self._rotate(key, cos, signed_sin)


# vLLM class name -> replacement (``CustomOp.register_oot`` keys by the replaced class's name).
REPLACEMENTS = {
    "RMSNorm": IsoExecRMSNorm,
    "GemmaRMSNorm": IsoExecGemmaRMSNorm,
    "RMSNormGated": IsoExecRMSNormGated,
    "SiluAndMul": IsoExecSiluAndMul,
    "RotaryEmbedding": IsoExecRotaryEmbedding,
}
