"""LoRA adapters (peft) on a transformers causal LM: several named adapters on one base model.

Shared by every runtime that trains or serves adapters (the Tinker server, a training backend's
``lora`` option): which linear layers an adapter covers, how it is initialised from a seed, how
one adapter is selected for a computation, and how an adapter is *merged* into base weights.

The merge is one function (``merged_weight``) so that every place that needs merged weights (the
inference engine after a weight update, a scorer that computes with merged weights) gets the same
bits from the same adapter tensors. peft is imported when a function is called.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    import torch

# Which linear layers (by the last component of their module name) each Tinker-style switch covers.
TARGET_GROUPS: dict[str, tuple[str, ...]] = {
    "attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
    "unembed": ("lm_head",),
}


def ties_unembedding(model: Any) -> bool:
    """True when the output projection shares its weight with the input embedding."""
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    return out is not None and inp is not None and out.weight is inp.weight


def target_modules(model: Any, groups: tuple[str, ...], *, unties_unembedding: bool = False) -> list[str]:
    """Names of the ``torch.nn.Linear`` modules of ``model`` that ``groups`` (keys of
    ``TARGET_GROUPS``) cover, in module order. Raises ``ValueError`` for an unknown group and when
    nothing matches.

    ``unembed`` on a model whose unembedding is tied to its embedding adapts the output projection
    only: merged, ``lm_head`` gets a weight of its own and the embedding lookup keeps the base one.
    Only a runtime whose engines take such an untied ``lm_head`` passes ``unties_unembedding`` (the
    Tinker server's in-process trainer: skyrl-torch unties on that update, vLLM is started from an
    untied copy); elsewhere it is refused (a backend's merged export would hand engines an
    ``lm_head`` their tied model ignores or writes into the embedding)."""
    import torch

    unknown = [g for g in groups if g not in TARGET_GROUPS]
    if unknown:
        raise ValueError(f"LoRA targets {unknown} unknown; allowed: {', '.join(TARGET_GROUPS)}")
    if "unembed" in groups and ties_unembedding(model) and not unties_unembedding:
        raise ValueError(
            "LoRA on the unembedding (train_unembed / targets: unembed) of a model that ties lm_head to "
            "embed_tokens is not supported by this runtime (the Tinker server's in-process trainer supports it). "
            "Train attention and MLP adapters only (train_unembed=False)."
        )
    suffixes = {s for g in groups for s in TARGET_GROUPS[g]}
    # A layer another adapter already wraps keeps its name; its linear is then the wrapper's base_layer.
    names = [
        name
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] in suffixes
        and isinstance(getattr(module, "base_layer", module), torch.nn.Linear)
    ]
    if not names:
        raise ValueError(f"LoRA targets {list(groups)} match no linear layer of this model")
    return names


def add_adapter(model: Any, name: str, *, rank: int, alpha: float, modules: list[str], seed: int) -> None:
    """Inject adapter ``name`` (rank ``rank``, scale ``alpha / rank``) into ``modules``.

    A is initialised from ``seed`` alone (peft's Kaiming-uniform) and B is zero, so the adapter
    starts as the base model and the same seed gives the same adapter whatever else is loaded.

    A and B are fp32 whatever the base model's dtype: they are the trained (master) weights, and
    their AdamW state follows them. (peft casts a new adapter to a bf16 base's dtype; it is cast
    back here, so over a bf16 base A starts rounded to bf16, as peft's own models have it.)"""
    import torch
    from peft import LoraConfig, inject_adapter_in_model

    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1; got {rank}")
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(modules), lora_dropout=0.0, bias="none")
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft warns that a second adapter joins the first: several adapters are the point here
        warnings.filterwarnings("ignore", message="Already found a `peft_config`")
        # and that an adapter on a tied lm_head is not tied to the embedding: here it never is
        # (``target_modules``: the merge gives lm_head a weight of its own)
        warnings.filterwarnings("ignore", message="Model has `tie_word_embeddings=True` and a tied layer")
        torch.manual_seed(seed)
        inject_adapter_in_model(config, model, adapter_name=name)
    for _, layer in lora_layers(model):
        if name in layer.lora_A:
            layer.lora_A[name].to(torch.float32)
            layer.lora_B[name].to(torch.float32)
    select(model, None)


def lora_layers(model: Any) -> Iterator[tuple[str, Any]]:
    """``(module name, peft LoRA layer)`` pairs; the name is the wrapped linear's original name."""
    from peft.tuners.lora import LoraLayer

    for module_name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            yield module_name, module


def select(model: Any, name: str | None) -> None:
    """Compute with adapter ``name`` only (``None``: the base model, every adapter off). Only the
    selected adapter's tensors require gradients."""
    for _, layer in lora_layers(model):
        if name is None:
            layer.enable_adapters(False)
            for param in layer.parameters():
                if param is not layer.get_base_layer().weight:
                    param.requires_grad_(False)
        else:
            layer.enable_adapters(True)
            layer.set_adapter(name)


def adapter_parameters(model: Any, name: str) -> list[torch.nn.Parameter]:
    """The trainable tensors of adapter ``name`` (A then B of every layer, in module order)."""
    params = []
    for _, layer in lora_layers(model):
        if name in layer.lora_A:
            params += [layer.lora_A[name].weight, layer.lora_B[name].weight]
    return params


def adapter_tensors(model: Any, name: str, *, live: bool = False) -> dict[str, torch.Tensor]:
    """Adapter ``name`` as named tensors: ``<module>.lora_A`` ``[r, in]``, ``<module>.lora_B``
    ``[out, r]`` and ``<module>.lora_scale`` (a 0-d tensor); detached copies, or (``live``) the
    adapter's own parameters, so that what is computed from them is differentiable."""
    import torch

    out: dict[str, torch.Tensor] = {}
    for module_name, layer in lora_layers(model):
        if name in layer.lora_A:
            a, b = layer.lora_A[name].weight, layer.lora_B[name].weight
            out[f"{module_name}.lora_A"] = a if live else a.detach().clone()
            out[f"{module_name}.lora_B"] = b if live else b.detach().clone()
            out[f"{module_name}.lora_scale"] = torch.tensor(float(layer.scaling[name]), dtype=torch.float32)
    return out


def load_adapter_tensors(model: Any, name: str, tensors: dict[str, torch.Tensor]) -> None:
    """Copy tensors written by ``adapter_tensors`` into adapter ``name`` (same modules and rank)."""
    import torch

    expected = set(adapter_tensors(model, name))
    if set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise ValueError(f"adapter tensors do not match adapter {name!r}: missing {missing[:3]}, unexpected {extra[:3]}")
    with torch.no_grad():
        for module_name, layer in lora_layers(model):
            if name in layer.lora_A:
                for part, module in (("lora_A", layer.lora_A[name]), ("lora_B", layer.lora_B[name])):
                    source = tensors[f"{module_name}.{part}"]
                    if source.shape != module.weight.shape:
                        raise ValueError(f"{module_name}.{part}: shape {tuple(source.shape)}, adapter has {tuple(module.weight.shape)}")
                    module.weight.copy_(source)


def merged_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``W + (B @ A) * scale`` in fp32: the one merge every runtime uses."""
    delta = (lora_b.float() @ lora_a.float()) * scale.float()
    return (weight.float() + delta).to(weight.dtype)


def adapted_weight_names(tensors: dict[str, torch.Tensor]) -> list[str]:
    """``<module>.weight`` of every module of an adapter (as ``adapter_tensors`` names them)."""
    return [f"{key[: -len('.lora_A')]}.weight" for key in tensors if key.endswith(".lora_A")]


def merged_weights(base: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(<module>.weight, merged)`` for every module of an adapter (``adapted_weight_names``), from
    ``base`` (``<module>.weight`` -> the base weight). Each is computed when iterated to, so a
    consumer that copies them away one by one (an engine's ``update_weights``) holds one at a time
    instead of a whole merged model."""
    for name in adapted_weight_names(tensors):
        m = name[: -len(".weight")]
        yield name, merged_weight(base[name], tensors[f"{m}.lora_A"], tensors[f"{m}.lora_B"], tensors[f"{m}.lora_scale"])


@functools.cache
def _low_rank_add() -> Any:
    """The autograd function of ``fused_forward``'s adapter term (built once, torch imported then)."""
    import torch

    class LowRankAdd(torch.autograd.Function):
        """``out += ((x A^T) * scale) B^T`` in place on ``out`` (the base layer's fresh output, which
        its backward does not need), with every product of backward taken rank-rows first
        (``[r, N] x [N, M]``): for SmolLM2's unembedding (M = 49152, N = 300) the gradient of B took
        34 ms in the ``[M, N] x [N, r]`` form autograd picks and 8 ms so, and the sum into a new
        output 22 ms against 3.5 in place (``docs/benchmarks.md``)."""

        @staticmethod
        def forward(ctx: Any, out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
            low = torch.mm(x, a.t()) * scale  # [N, r]
            out.addmm_(low.to(out.dtype), b.t().to(out.dtype))
            ctx.mark_dirty(out)
            ctx.save_for_backward(x, a, b, low)
            ctx.scale = scale
            return out

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
            x, a, b, low = ctx.saved_tensors
            g = grad.to(b.dtype)
            grad_b = torch.mm(low.t(), g).t()  # [M, r]
            grad_low = torch.mm(b.t(), g.t()).t() * ctx.scale  # [N, r]
            grad_a = torch.mm(grad_low.t(), x)  # [r, K]
            grad_x = torch.mm(grad_low, a).to(x.dtype) if ctx.needs_input_grad[1] else None
            return grad, grad_x, grad_a, grad_b, None

    return LowRankAdd


@contextlib.contextmanager
def fused_forward(model: Any, name: str) -> Iterator[None]:
    """Within the block, each linear layer carrying adapter ``name`` computes
    ``base(x) + ((x A^T) * scale) B^T`` with the scale on the rank-wide product and the sum inside
    one ``addmm``, instead of peft's ``base(x) + (x A^T B^T) * scale``: the same mathematics (fp32
    rounding apart) without two output-wide elementwise passes (the scaling and the sum) and their
    backward, about 7% of a SmolLM2 LoRA training step on CPU. The unembedding's adapter
    (vocabulary-wide outputs) instead sums in place on the base layer's output and takes
    backward's thin products in their fast form (``_low_rank_add``; on the narrower layers that
    measured no faster). Only for a plain LoRA (no dropout, no DoRA or other variant); other
    layers keep peft's forward."""
    import torch
    from peft.tuners.lora.layer import Linear

    low_rank_add = _low_rank_add()

    def forward(layer: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = layer.base_layer(x, *args, **kwargs)
        a, b = layer.lora_A[name].weight, layer.lora_B[name].weight
        low = torch.mm(x.reshape(-1, x.shape[-1]).to(a.dtype), a.t()) * layer.scaling[name]
        return torch.addmm(out.reshape(-1, out.shape[-1]), low.to(out.dtype), b.t().to(out.dtype)).view(out.shape)

    def vocabulary_wide(layer: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = layer.base_layer(x, *args, **kwargs)
        a, b = layer.lora_A[name].weight, layer.lora_B[name].weight
        flat = low_rank_add.apply(out.reshape(-1, out.shape[-1]), x.reshape(-1, x.shape[-1]).to(a.dtype), a, b, float(layer.scaling[name]))
        return flat.view(out.shape)

    patched = []
    for _, layer in lora_layers(model):
        plain = (isinstance(layer, Linear) and name in layer.lora_A and name not in layer.lora_variant
                 and isinstance(layer.lora_dropout[name], torch.nn.Identity) and not layer.merged)
        if plain:
            wide = layer is model.get_output_embeddings()
            layer.forward = functools.partial(vocabulary_wide if wide else forward, layer)
            patched.append(layer)
    try:
        yield
    finally:
        for layer in patched:
            del layer.forward
