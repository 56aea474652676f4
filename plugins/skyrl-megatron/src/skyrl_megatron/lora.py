"""LoRA in the Megatron backend (``backend.options.lora: {rank, alpha, targets}``).

The adapter is peft's, made on the Hugging Face model the rank is built from
(``skyrl_core.lora.add_adapter``): the same seed gives the same A and B as the FSDP backend and the
Tinker server's in-process trainer. Each targeted megatron linear keeps its weight and its name
(checkpoints, weight conversion and the op sites see the model they know) and gets a submodule
``lora`` holding one (A, B) pair per Hugging Face projection it fuses (``linear_qkv``: q, k, v;
``linear_fc1``: gate, up); a forward hook adds ``scale * B (A x)`` laid out as the linear's rows
are (this rank's query groups for ``linear_qkv``, its gate rows then its up rows for
``linear_fc1``). So a fused linear trains exactly the adapters peft would put on its parts, and
``export`` gives them back under peft's names. What leaves as full weights is the adapter merged
into the base (``skyrl_core.lora.merged_weights``), as in the FSDP backend.

Tensor parallelism splits each adapter as its linear is split:

- column-parallel linears (``linear_qkv``, ``linear_fc1``, an untied ``output_layer``): B's rows
  are split like the weight's; A is whole on every rank, each rank's share of its gradient is
  summed over the tensor-parallel group (``PARTIAL_GRADIENT``, as megatron sums its replicated
  q/k norms'), and the adapter's input goes through ``copy_to_tensor_model_parallel_region`` so
  the gradient it sends back is summed like the linear's own;
- row-parallel linears (``linear_proj``, ``linear_fc2``): A's columns are split like the weight's
  and its product with this rank's share of the input is summed over the group
  (``reduce_from_tensor_model_parallel_region``) before B, which is whole on every rank.

MoE and hybrid models and CUDA ranks are refused (``check`` and the rank name why). On CUDA,
Transformer Engine's fused-norm linear would see the hidden state before its norm: the GPU path
would need the local layers for these hooks.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from skyrl_core.lora_options import LoraOptions
from skyrl_megatron.collectives import all_gather
from skyrl_megatron.layout import GPTLayout

ADAPTER = "default"
# A parameter attribute: each tensor-parallel rank holds part of its gradient (summed by the optimizer).
PARTIAL_GRADIENT = "gradient_summed_across_tensor_parallel"

# Target group -> (megatron module under a decoder layer, the Hugging Face projections it fuses in row order).
LAYER_TARGETS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "attn": (
        ("self_attention.linear_qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        ("self_attention.linear_proj", ("self_attn.o_proj",)),
    ),
    "mlp": (
        ("mlp.linear_fc1", ("mlp.gate_proj", "mlp.up_proj")),
        ("mlp.linear_fc2", ("mlp.down_proj",)),
    ),
}
ROW_PARALLEL = ("linear_proj", "linear_fc2")


def check(options: LoraOptions, layout: GPTLayout) -> None:
    """Refuse a model LoRA here does not cover, naming the option."""
    if layout.model_type not in ("llama", "qwen3"):
        raise ValueError(
            f"backend.options.lora: LoRA in the megatron backend covers dense Llama and Qwen3 models; "
            f"this model is {layout.model_type!r}"
        )
    if "unembed" in options.targets and layout.tied_embeddings:
        raise ValueError(
            "backend.options.lora.targets: unembed needs an untied lm_head; this model ties lm_head to "
            "embed_tokens. Train attention and MLP adapters only"
        )


class FusedLora(torch.nn.Module):
    """The adapters of one megatron linear: ``lora_A[i]`` ``[r, in]`` and ``lora_B[i]`` ``[out_i, r]``
    for its ``i``-th fused projection (this rank's share of them); ``fuse`` lays the projections'
    outputs out as the linear's rows; ``enter`` and ``reduce`` are the tensor-parallel regions
    around the input and the rank-wide product (identity at tensor parallel 1)."""

    def __init__(self, a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], scale: float,
                 fuse: Callable[[list[torch.Tensor]], torch.Tensor], *, row_parallel: bool, tp: int) -> None:
        super().__init__()
        self.lora_A = torch.nn.ParameterList([torch.nn.Parameter(t.detach().float().clone()) for t in a])
        self.lora_B = torch.nn.ParameterList([torch.nn.Parameter(t.detach().float().clone()) for t in b])
        self.scale, self.fuse, self.row_parallel, self.tp = scale, fuse, row_parallel, tp
        # What the optimizer's gradient norm counts per rank (skyrl_megatron.optimizers.ShardedAdamW).
        for p in self.lora_A if row_parallel else self.lora_B:
            p.tensor_model_parallel = tp > 1
        if not row_parallel and tp > 1:
            for p in self.lora_A:
                setattr(p, PARTIAL_GRADIENT, True)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region

        if self.tp > 1 and not self.row_parallel:
            x = copy_to_tensor_model_parallel_region(x)
        parts = []
        for a, b in zip(self.lora_A, self.lora_B):
            low = torch.nn.functional.linear(x, a)
            if self.tp > 1 and self.row_parallel:
                low = reduce_from_tensor_model_parallel_region(low)
            parts.append(torch.nn.functional.linear(low, b) * self.scale)
        return self.fuse(parts)


def _add_delta(module: torch.nn.Module, args: tuple, output: Any) -> Any:
    x = args[0]
    if isinstance(output, tuple):  # megatron's linears return (output, bias)
        return (output[0] + module.lora.delta(x).to(output[0].dtype), *output[1:])
    return output + module.lora.delta(x).to(output.dtype)


def _fuse_qkv(layout: GPTLayout, tp: int) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    groups, per_group, hd = layout.num_kv_heads // tp, layout.heads_per_group, layout.head_dim

    def fuse(parts: list[torch.Tensor]) -> torch.Tensor:
        q, k, v = parts  # each query group's heads, then its key and its value (skyrl_megatron.convert)
        return torch.cat([q.unflatten(-1, (groups, per_group * hd)), k.unflatten(-1, (groups, hd)),
                          v.unflatten(-1, (groups, hd))], dim=-1).flatten(-2)

    return fuse


def _fuse_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def targets(layout: GPTLayout, groups: Sequence[str]) -> list[tuple[str, tuple[str, ...]]]:
    """``(megatron module, Hugging Face modules it fuses)`` of every adapted linear, in layer order."""
    out = []
    for i in range(layout.num_layers):
        for group in groups:
            for module, parts in LAYER_TARGETS.get(group, ()):
                out.append((f"decoder.layers.{i}.{module}", tuple(f"model.layers.{i}.{p}" for p in parts)))
    if "unembed" in groups:
        out.append(("output_layer", ("lm_head",)))
    return out


def _is_row_parallel(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ROW_PARALLEL


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, 0, 0, rows - t.shape[0]))


def attach(model: torch.nn.Module, hf_model: Any, options: LoraOptions, layout: GPTLayout, *, seed: int,
           tp: int, tp_rank: int) -> None:
    """Freeze ``model`` and give its targeted linears this rank's share of the adapter peft makes
    on ``hf_model`` with ``seed`` (so A is the same draw as every other runtime's; B starts at 0)."""
    from skyrl_core import lora

    lora.add_adapter(hf_model, ADAPTER, rank=options.rank, alpha=options.alpha,
                     modules=lora.target_modules(hf_model, options.targets), seed=seed)
    tensors = lora.adapter_tensors(hf_model, ADAPTER)
    model.requires_grad_(False)
    modules = dict(model.named_modules())
    scale = options.alpha / options.rank
    for name, parts in targets(layout, options.targets):
        a = [tensors[f"{p}.lora_A"] for p in parts]
        b = [tensors[f"{p}.lora_B"] for p in parts]
        row = _is_row_parallel(name)
        if row:
            a = [t.chunk(tp, dim=1)[tp_rank] for t in a]
        else:
            if name == "output_layer":  # the vocabulary padded to a multiple of tp (zero rows: no delta)
                b = [_pad_rows(t, layout.padded_vocab_size(tp)) for t in b]
            b = [t.chunk(tp, dim=0)[tp_rank] for t in b]
        fuse = _fuse_qkv(layout, tp) if name.endswith("linear_qkv") else _fuse_rows
        linear = modules[name]
        linear.lora = FusedLora(a, b, scale, fuse, row_parallel=row, tp=tp)
        linear.register_forward_hook(_add_delta)


def is_adapter_parameter(name: str) -> bool:
    return ".lora.lora_A." in name or ".lora.lora_B." in name


def export(model: torch.nn.Module, layout: GPTLayout, groups: Sequence[str], *, tp: int, tp_group: Any) -> dict[str, torch.Tensor]:
    """The whole adapter under peft's names (``<hf module>.lora_A.default.weight``), fp32 on the
    CPU, the tensor-parallel shares gathered. Collective over ``tp_group``."""
    fused = {name[: -len(".lora")]: m for name, m in model.named_modules() if isinstance(m, FusedLora)}
    out: dict[str, torch.Tensor] = {}
    for name, parts in targets(layout, groups):
        adapter = fused[name]
        row = _is_row_parallel(name)
        for part, a, b in zip(parts, adapter.lora_A, adapter.lora_B):
            a, b = a.detach().float().contiguous(), b.detach().float().contiguous()
            if tp > 1:
                if row:
                    a = torch.cat(all_gather(a, tp_group), dim=1)
                else:
                    b = torch.cat(all_gather(b, tp_group), dim=0)
            if name == "output_layer":
                b = b[: layout.vocab_size]
            out[f"{part}.lora_A.{ADAPTER}.weight"] = a.cpu().clone()
            out[f"{part}.lora_B.{ADAPTER}.weight"] = b.cpu().clone()
    return out


def merged(hf_weights: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], options: LoraOptions) -> dict[str, torch.Tensor]:
    """Hugging Face weights with the adapter (``export``'s names) merged into its modules."""
    from skyrl_core import lora

    scale = torch.tensor(options.alpha / options.rank, dtype=torch.float32)
    out = dict(hf_weights)
    suffix = f".lora_A.{ADAPTER}.weight"
    for key, a in adapter.items():
        if key.endswith(suffix):
            module = key[: -len(suffix)]
            out[f"{module}.weight"] = lora.merged_weight(out[f"{module}.weight"], a, adapter[f"{module}.lora_B.{ADAPTER}.weight"], scale)
    return out
