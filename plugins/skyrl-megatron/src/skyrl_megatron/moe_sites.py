"""Op sites of megatron-core's ``MoELayer``: router, experts and combine as the ops ``moe_router``,
``moe_experts`` and ``moe_combine`` (calling conventions in ``skyrl_core.ops.hf``), the way
``skyrl_core.ops.hf`` routes transformers' sparse-MoE blocks.

With the stock implementations installed the layer's own forward runs (megatron's router, token
dispatcher and ``SequentialMLP``). With non-stock ones the layer computes what a transformers model
of the same weights computes, on the same shapes, whatever the expert-parallel degree:

- the router op on every token of this rank (the router weight is replicated);
- the experts op on every token of this rank (under sequence parallelism: of its share of the
  sequence) with **all** experts: the local experts' ``linear_fc1`` (``[gate; up]``,
  transformers' ``gate_up_proj[e]``) and ``linear_fc2`` (``down_proj[e]``) are stacked and
  all-gathered over the expert-tensor-parallel group (their row / column pieces) and the
  expert-parallel group (their experts). Tokens are not dispatched: a token's
  result then depends on that token and the weights only, not on which rank holds its experts.
  Backward of the gather sums the expert gradients over the expert-parallel group (each rank's
  tokens contribute to every expert) and keeps this rank's experts: the gradient megatron's
  all-gather dispatcher gives the expert's owner;
- the combine op in slot order, with the shared expert's output and gate logits when the layer has a
  gated shared expert (Qwen3-Next): the shared expert's linears and ``silu_mul`` go through their
  own ops, its gate logits through ``linear``.

The price: every expert-parallel rank gathers every expert's weights on every call (expert
parallelism then splits parameter and optimizer memory, not expert compute).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _group_size(group: Any) -> int:
    if group is None:
        return 1
    size = group.size() if hasattr(group, "size") else dist.get_world_size(group)
    return int(size)


class _GatherExpertShards(torch.autograd.Function):
    """All-gather the ranks' pieces of the stacked expert weights along ``dim`` into the whole
    tensor; ``halves``: each piece is ``[gate_r; up_r]`` on ``dim`` (a SwiGLU ``linear_fc1`` split
    by expert tensor parallelism), reassembled as ``[gate; up]``. Backward: the gradient summed over
    the group (each rank's tokens reach every expert), this rank's piece kept."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: Any, dim: int, halves: bool) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.dim, ctx.halves = group, dist.get_rank(group), dim, halves
        ctx.world = dist.get_world_size(group)
        parts = [torch.empty_like(local) for _ in range(ctx.world)]
        dist.all_gather(parts, local.contiguous(), group=group)
        if not halves:
            return torch.cat(parts, dim=dim)
        pairs = [p.chunk(2, dim=dim) for p in parts]
        return torch.cat([g for g, _ in pairs] + [u for _, u in pairs], dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        halves = grad.chunk(2, dim=ctx.dim) if ctx.halves else (grad,)
        mine = torch.cat([h.chunk(ctx.world, dim=ctx.dim)[ctx.rank] for h in halves], dim=ctx.dim)
        return mine, None, None, None


def _all_experts(module: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gate_up_proj [E, 2F, H], down_proj [E, H, F])`` in transformers' layout, every expert:
    the local experts' pieces gathered over the expert-tensor-parallel group (``linear_fc1`` split
    on rows, ``linear_fc2`` on columns), then their experts over the expert-parallel group."""
    experts = module.experts
    local = getattr(experts, "local_experts", None)
    if local is None:
        raise NotImplementedError(f"{module._skyrl_name}: {type(experts).__name__} experts (supported: SequentialMLP)")
    gate_up = torch.stack([e.linear_fc1.weight for e in local])
    down = torch.stack([e.linear_fc2.weight for e in local])
    if _group_size(experts.tp_group) > 1:
        gate_up = _GatherExpertShards.apply(gate_up, experts.tp_group, 1, True)
        down = _GatherExpertShards.apply(down, experts.tp_group, 2, False)
    if _group_size(experts.ep_group) > 1:
        gate_up = _GatherExpertShards.apply(gate_up, experts.ep_group, 0, False)
        down = _GatherExpertShards.apply(down, experts.ep_group, 0, False)
    return gate_up, down


def _shared_expert(module: Any, x: torch.Tensor, dispatch: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The shared expert's output and gate logits (None, None without a shared expert)."""
    shared = module.shared_experts
    if shared is None:
        return None, None
    silu_mul = dispatch.resolve("silu_mul", shared)
    if silu_mul is None:
        raise ValueError("silu_mul must be non-stock where the MoE ops are (the shared expert computes it)")
    gate, up = shared.linear_fc1(x)[0].chunk(2, dim=-1)
    hidden = silu_mul(gate, up)
    dispatch.emit("silu_mul", shared, hidden)
    out = shared.linear_fc2(hidden)[0]
    logits = None
    if shared.use_shared_expert_gate:
        linear = dispatch.resolve("linear", shared)
        if linear is None:
            raise ValueError("linear must be non-stock where the MoE ops are (the shared expert's gate computes it)")
        logits = linear(x, shared.gate_weight, None)
    return out, logits


def moe_layer_forward(module: Any, hidden_states: torch.Tensor, intermediate_tensors: Any = None, padding_mask: Any = None):
    dispatch = module._skyrl_dispatch
    fns = [dispatch.resolve(op, module) for op in ("moe_router", "moe_experts", "moe_combine")]
    if all(fn is None for fn in fns):
        return module._skyrl_stock_forward(hidden_states, intermediate_tensors=intermediate_tensors, padding_mask=padding_mask)
    if any(fn is None for fn in fns):
        raise ValueError("moe_router, moe_experts and moe_combine must be all stock or all non-stock at one site")
    if intermediate_tensors is not None:
        raise NotImplementedError(f"{module._skyrl_name}: partial MoE execution (CUDA graphs)")
    router_fn, experts_fn, combine_fn = fns
    config = module.config
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    weights, chosen = router_fn(x, module.router.weight, int(config.moe_router_topk), not config.moe_router_pre_softmax)
    dispatch.emit("moe_router", module, weights)
    gate_up, down = _all_experts(module)
    expert_out = experts_fn(x, chosen, gate_up, down)
    dispatch.emit("moe_experts", module, expert_out)
    shared_out, shared_logits = _shared_expert(module, x, dispatch)
    out = combine_fn(expert_out, weights, shared_out, shared_logits)
    dispatch.emit("moe_combine", module, out)
    return out.reshape(shape), None


def check_moe_layer(module: Any) -> str | None:
    """Why ``module`` (a ``MoELayer``) cannot take the op path, or None: the ops' convention is
    Qwen3's softmax top-k routing (renormalised or not), SwiGLU experts, no aux-loss-free bias."""
    config = module.config
    reasons = []
    if config.moe_router_score_function != "softmax":
        reasons.append(f"router score function {config.moe_router_score_function!r}")
    if getattr(module.router, "enable_expert_bias", False) or config.moe_router_num_groups:
        reasons.append("expert bias / grouped routing")
    if (config.moe_router_topk_scaling_factor or 1.0) != 1.0:
        reasons.append("a top-k scaling factor")
    if not config.gated_linear_unit or config.activation_func is not torch.nn.functional.silu:
        reasons.append("non-SwiGLU experts")
    if getattr(config, "moe_latent_size", None):
        reasons.append("latent projections")
    return ", ".join(reasons) or None
