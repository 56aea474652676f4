"""Canonical GatedDeltaNet (Qwen3-Next linear attention): causal conv and the gated delta rule.

One scan form at every site: the recurrent form with an fp32 state, token after token, so a
prefill of T tokens and T decode steps (or a prefill split anywhere) perform the same operations
on the same values. The chunked form transformers uses for prefill is a different summation and
never matches decode bit for bit (DESIGN.md section 6). Reductions over the key dimension are
tree sums; gates use layout-independent exp/log1p forms.
"""

from __future__ import annotations

import torch

from skyrl_isoexec.kernels.reduce import sigmoid, silu, softplus, tree_sum


def conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu(causal depthwise conv)`` over ``x`` ``[B, T, C]`` with taps ``weight`` ``[C, W]``.

    ``conv_state`` ``[B, C, W-1]`` holds the previous inputs (None: zeros). The taps are summed
    oldest to newest in fp32. Returns the output ``[B, T, C]`` (x's dtype) and the new state.
    """
    batch, steps, channels = x.shape
    width = weight.shape[-1]
    if conv_state is None:
        history = x.new_zeros(batch, width - 1, channels)
    else:
        history = conv_state.transpose(1, 2).to(x.dtype)
    inputs = torch.cat((history, x), dim=1)  # [B, W-1+T, C]
    taps = weight.float()
    acc = inputs[:, 0:steps].float() * taps[:, 0]
    for i in range(1, width):
        acc = acc + inputs[:, i : i + steps].float() * taps[:, i]
    if bias is not None:
        acc = acc + bias.float()
    return silu(acc).to(x.dtype), inputs[:, -(width - 1) :].transpose(1, 2).contiguous()


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(tree_sum(x * x) + 1e-6).unsqueeze(-1)


def core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule, recurrent, fp32 state ``[B, Hv, Dk, Dv]``.

    ``q``/``k`` ``[B, T, Hk, Dk]`` (repeated to ``Hv`` heads), ``v`` ``[B, T, Hv, Dv]``, ``a``/``b``
    ``[B, T, Hv]`` the raw decay and write-strength projections. Returns the output ``[B, T, Hv, Dv]``
    in v's dtype and the final state.
    """
    dtype = v.dtype
    batch, steps, v_heads, v_dim = v.shape
    k_dim = k.shape[-1]
    if k.shape[2] != v_heads:
        q = q.repeat_interleave(v_heads // q.shape[2], dim=2)
        k = k.repeat_interleave(v_heads // k.shape[2], dim=2)
    q = _l2norm(q.float()) / (k_dim**0.5)
    k = _l2norm(k.float())
    v = v.float()
    beta = sigmoid(b.float())
    decay = torch.exp(-torch.exp(A_log.float()) * softplus(a.float() + dt_bias.float()))  # [B, T, Hv]
    if state is None:
        state = v.new_zeros(batch, v_heads, k_dim, v_dim)
    else:
        state = state.float()
    outputs = []
    for t in range(steps):
        k_t = k[:, t].unsqueeze(-1)  # [B, Hv, Dk, 1]
        state = state * decay[:, t, :, None, None]
        remembered = tree_sum(state * k_t, dim=-2)  # [B, Hv, Dv]
        delta = (v[:, t] - remembered) * beta[:, t, :, None]
        state = state + k_t * delta.unsqueeze(-2)
        outputs.append(tree_sum(state * q[:, t].unsqueeze(-1), dim=-2))
    return torch.stack(outputs, dim=1).to(dtype), state
