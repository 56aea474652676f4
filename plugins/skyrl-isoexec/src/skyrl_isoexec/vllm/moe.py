"""vLLM's mixture-of-experts layer (``FusedMoE``, Qwen3-MoE) on the canonical MoE kernels.

vLLM builds a sparse MoE block as a ``MoERunner``: a ``GateLinear`` (the router's GEMM), a router
(softmax, top-k, renormalisation) and ``RoutedExperts`` holding every expert's merged gate/up
weight ``w13_weight`` ``[E, 2I, H]`` (gate rows first, as transformers' ``gate_up_proj``) and
down weight ``w2_weight`` ``[E, H, I]``. On CPU its ``UnquantizedFusedMoEMethod`` repacks those
weights into a grouped-GEMM layout and routes inside one fused kernel. Both classes are vLLM
pluggable layers, so IsoExec replaces them out of tree (``CustomOp.register_oot``, keyed by class
name):

- ``IsoExecUnquantizedFusedMoEMethod``: built with IsoExec on, it keeps the plain weights (so
  in-place weight reloads keep working) and marks its layer canonical;
- ``IsoExecMoERunner``: over canonical experts it computes exactly the trainer's MoE block
  (``skyrl_core.ops.hf``'s sparse-MoE forward with IsoExec's ops): ``kernels.moe.router`` over the
  gate's weight, ``kernels.moe.experts`` over the plain expert weights, ``kernels.moe.combine``.

A shared expert (Qwen3-Next) is vLLM's MLP with a sigmoid ``expert_gate`` applied inside it; the
runner calls its projections and activation (vLLM's layers, routed to the canonical ops by
skyrl-vllm's op sites) and its gate, and
``kernels.moe.combine`` applies the gate in fp32 as the trainer's combine does.

What this cannot make identical is refused at load (``problems``): routing other than softmax
top-k (grouped top-k, score bias, custom routing, a scaling factor), an activation other than
SiLU, expert biases, expert parallelism, input/output transforms, and shared experts of another
form (fused into the routed GEMM, or without their sigmoid gate).
A block built while IsoExec is off in this process keeps vLLM's own code.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

from skyrl_isoexec.kernels import linear as canonical_linear
from skyrl_isoexec.kernels import moe as canonical
from skyrl_isoexec.vllm import runtime


class IsoExecUnquantizedFusedMoEMethod(runtime.DecidedAtBuild, UnquantizedFusedMoEMethod):
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if not self._isoexec:
            return super().process_weights_after_loading(layer)
        dtype = layer.w13_weight.dtype
        if dtype not in canonical_linear.SUPPORTED_DTYPES:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in canonical_linear.SUPPORTED_DTYPES)
            raise ValueError(f"IsoExec: {layer.layer_name} has {dtype} expert weights; canonical GEMMs run in {allowed}")
        layer._isoexec_moe = True  # plain [E, 2I, H] and [E, H, I] weights, as loaded


class IsoExecMoERunner(runtime.DecidedAtBuild, MoERunner):
    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        experts = self.routed_experts
        if not (self._isoexec and getattr(experts, "_isoexec_moe", False)):
            return super().forward(hidden_states, router_logits, *args, **kwargs)
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        # The gate's GEMM is the router's own (the trainer's router is not a separate linear module).
        weights, chosen = canonical.router(x, self.gate.weight, int(experts.top_k), bool(experts.renormalize))
        runtime.observe("moe_router", self)
        expert_out = canonical.experts(x, chosen, experts.w13_weight, experts.w2_weight)
        runtime.observe("moe_experts", self)
        shared_out = shared_logits = None
        shared = _shared_mlp(self)
        if shared is not None:  # Qwen3-Next: sigmoid(gate(x)) * mlp(x), the gate applied in combine
            gate_up, _ = shared.gate_up_proj(x)
            shared_out, _ = shared.down_proj(shared.act_fn(gate_up))
            shared_logits, _ = shared.expert_gate(x)
        out = canonical.combine(expert_out, weights, shared_out, shared_logits)
        runtime.observe("moe_combine", self)
        return out.reshape(shape)


def _shared_mlp(runner: torch.nn.Module) -> torch.nn.Module | None:
    """The shared expert's MLP (gate/up, act, down, and its ``expert_gate``), or None."""
    wrapper = runner.shared_experts
    return None if wrapper is None else getattr(wrapper, "_layer", None)


def problems(runner: torch.nn.Module) -> list[str]:
    """Why the canonical MoE cannot stand for ``runner``'s computation (empty when it can)."""
    if not isinstance(runner, IsoExecMoERunner) or not runner._isoexec:
        return [f"it is vLLM's {type(runner).__name__}"]
    experts = runner.routed_experts
    found = []
    if not getattr(experts, "_isoexec_moe", False):
        found.append(f"its experts use {type(experts.quant_method).__name__}")
    if experts.scoring_func != "softmax":
        found.append(f"scoring_func={experts.scoring_func!r} (the canonical router is a softmax)")
    if experts.use_grouped_topk or experts.custom_routing_function is not None:
        found.append("grouped or custom top-k routing")
    if experts.e_score_correction_bias is not None:
        found.append("an expert score correction bias")
    for scaling in (runner.routed_scaling_factor, experts.routed_scaling_factor):
        if float(scaling) != 1.0:
            found.append(f"routed_scaling_factor={scaling}")
    activation = getattr(experts.activation, "value", experts.activation)
    if activation != "silu":
        found.append(f"activation {activation!r} (the canonical experts compute SiLU(gate) * up)")
    if getattr(experts.moe_config, "has_bias", False):
        found.append("expert biases")
    if experts.apply_router_weight_on_input:
        found.append("router weights applied to the input")
    if experts.expert_map is not None or experts.local_num_experts != experts.global_num_experts:
        found.append("expert parallelism (each rank holds some experts)")
    if runner.routed_input_transform is not None or runner.routed_output_transform is not None:
        found.append("a routed input/output transform")
    if runner.shared_expert_gate is not None:
        found.append("a shared-expert gate outside the shared expert (fused shared experts)")
    if runner.shared_experts is not None:
        mlp = _shared_mlp(runner)
        parts = ("gate_up_proj", "act_fn", "down_proj", "expert_gate")
        if mlp is None or any(getattr(mlp, p, None) is None for p in parts):
            found.append("shared experts without a gate/up, SiLU, down MLP and a sigmoid gate (Qwen3-Next's form)")
    gate = runner.gate
    if gate is None:
        found.append("no gate module (router logits computed by the caller)")
    elif gate.weight.dtype != experts.w13_weight.dtype:
        found.append(f"a {gate.weight.dtype} router over {experts.w13_weight.dtype} experts")
    return found


# vLLM class name -> replacement (``register_oot`` keys by the replaced class's name).
REPLACEMENTS = {
    "UnquantizedFusedMoEMethod": IsoExecUnquantizedFusedMoEMethod,
    "MoERunner": IsoExecMoERunner,
}
