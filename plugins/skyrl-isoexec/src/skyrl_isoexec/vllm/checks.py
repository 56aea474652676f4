"""What IsoExec refuses inside vLLM, and the inspection of a built model that proves coverage.

Refusals are one sentence each, naming what was given and why it cannot be made bitwise equal to
the trainer. ``config_problems`` runs on vLLM's config in the front-end (before any process
starts) and again in the worker; ``inspect_model`` walks the model the worker built (and
skyrl-vllm's op sites routed) and reports every module that computes something without a
canonical implementation.
"""

from __future__ import annotations

import os
from typing import Any

# vLLM architectures whose every op has a canonical implementation inside vLLM.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM")

PREFIX = "IsoExec cannot make vLLM bitwise identical to the trainer"


class IsoExecRefusal(ValueError):
    """A vLLM configuration or model that IsoExec cannot make identical to the trainer."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(f"{PREFIX}: " + "; ".join(problems))


def set_canonical_defaults(vllm_config: Any) -> None:
    """Settings left to vLLM (``auto``) that the canonical ops need, set in the front-end's config
    (which the engine processes receive): a GatedDeltaNet model's recurrent state cache in fp32
    (the canonical delta rule carries an fp32 state; vLLM's ``auto`` is the model dtype)."""
    cache = vllm_config.cache_config
    if getattr(cache, "mamba_ssm_cache_dtype", None) == "auto":
        cache.mamba_ssm_cache_dtype = "float32"


def config_problems(vllm_config: Any) -> list[str]:
    """Every reason ``vllm_config`` cannot run the canonical ops, one sentence each."""
    model = vllm_config.model_config
    problems: list[str] = []
    if model.quantization is not None:
        problems.append(f"quantization={model.quantization!r} replaces the GEMMs by quantized kernels (use an unquantized model)")
    if model.logprobs_mode != "raw_logprobs":
        problems.append(
            f"logprobs_mode={model.logprobs_mode!r} returns values other than the raw-logit log-softmax "
            "the trainer computes (use 'raw_logprobs')"
        )
    dtype = str(model.dtype).removeprefix("torch.")
    if dtype not in ("float32", "bfloat16"):
        problems.append(f"dtype={dtype!r} has no canonical kernels (use float32 or bfloat16)")
    head_dtype = getattr(model, "head_dtype", None)
    if head_dtype is not None and head_dtype != model.dtype:
        problems.append(f"head_dtype={head_dtype} computes the lm_head in another dtype than the trainer's lm_head")
    archs = list(getattr(model, "architectures", None) or [])
    unsupported = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
    if unsupported or not archs:
        problems.append(
            f"architecture {', '.join(unsupported or ['(none)'])} has no canonical ops inside vLLM "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    ssm_dtype = getattr(vllm_config.cache_config, "mamba_ssm_cache_dtype", "float32")
    if ssm_dtype not in ("float32", "auto"):
        problems.append(f"mamba_ssm_cache_dtype={ssm_dtype!r} keeps GatedDeltaNet's recurrent state in another dtype "
                        "than the trainer's fp32 (use float32 or auto)")
    cache_dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto")
    if cache_dtype not in ("auto", None):
        problems.append(f"kv_cache_dtype={cache_dtype!r} stores keys and values in another dtype than the model's")
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        problems.append(
            f"tensor_parallel_size={parallel.tensor_parallel_size}, pipeline_parallel_size="
            f"{parallel.pipeline_parallel_size} split GEMM reductions across ranks (use 1 and 1)"
        )
    if getattr(vllm_config, "speculative_config", None) is not None:
        problems.append("speculative decoding scores tokens with a draft model and a rejection sampler")
    mode = getattr(vllm_config.compilation_config, "mode", None)
    if mode is not None and getattr(mode, "name", str(mode)) != "NONE":
        problems.append(
            f"compilation mode {getattr(mode, 'name', mode)} lets torch.compile fuse the canonical ops and change "
            "their rounding (use enforce_eager=True)"
        )
    problems.extend(_accelerator_problems(vllm_config))
    if os.environ.get("VLLM_BATCH_INVARIANT", "0") not in ("", "0"):
        problems.append("VLLM_BATCH_INVARIANT=1 swaps in vLLM's own batch-invariant kernels over the canonical ones")
    return problems


def _accelerator_problems(vllm_config: Any) -> list[str]:
    """On CUDA (any non-CPU platform) the canonical attention sits in vLLM's CUSTOM backend slot,
    selected by ``attention_config.backend``, and the V1 model runner hosts the sampler patch."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return []
    problems = []
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    if getattr(backend, "name", backend) != "CUSTOM":
        problems.append(
            f"attention backend {getattr(backend, 'name', backend)!r} is vLLM's own kernel "
            "(set attention_config={'backend': 'CUSTOM'}: IsoExec registers the canonical one there)"
        )
    if getattr(vllm_config, "use_v2_model_runner", False):
        problems.append("vLLM's V2 model runner is not covered by IsoExec (set VLLM_USE_V2_MODEL_RUNNER=0)")
    return problems


def allowlist_problem() -> str | None:
    """Why vLLM would skip skyrl's bootstrap under ``VLLM_PLUGINS`` (then nothing runs in its workers)."""
    allow = os.environ.get("VLLM_PLUGINS")
    if allow is None:
        return None
    from importlib.metadata import entry_points

    ours = sorted(ep.name for ep in entry_points(group="vllm.general_plugins") if ep.value.startswith("skyrl"))
    names = {n.strip() for n in allow.split(",") if n.strip()}
    if not ours or names & set(ours):
        return None
    return (
        f"VLLM_PLUGINS={allow!r} excludes skyrl's vLLM bootstrap ({', '.join(ours)}), so vLLM's workers would run "
        "stock ops (add it to VLLM_PLUGINS or unset it)"
    )


def routed_ledger(model: Any) -> Any:
    """The op ledger skyrl-vllm's op sites attached to ``model`` when they routed it; refused
    without one (the op sites off: vLLM's own kernels would compute the other ops)."""
    ledger = getattr(model, "_skyrl_op_ledger", None)
    if ledger is None or "routed" not in ledger.meta:
        raise IsoExecRefusal([
            f"skyrl-vllm's op sites did not route {type(model).__name__}'s layers in this process (SKYRL_VLLM_OP_SITES=0, "
            "or not skyrl's bootstrap), so vLLM's own kernels would compute its linear, norm, rotary and logprob ops"
        ])
    return ledger


def inspect_model(model: Any, routed: dict[str, Any]) -> tuple[dict[str, int], list[str], list[str]]:
    """``(op_modules, patched, unpatched)`` of a model built by vLLM with IsoExec on, given what
    skyrl-vllm's op sites routed in it (``routed``: their ledger's ``meta``).

    ``op_modules`` counts the modules computing each op canonically; ``patched`` names them (IsoExec's
    own layers are given their name as ``_isoexec_name``, under which they record their calls, so
    the ledger shows which ones ran at each site); ``unpatched`` names every module that computes
    something (an op class, or parameters) without a canonical implementation, those the op sites
    could not route included.
    """
    from vllm.model_executor.custom_op import CustomOp, PluggableLayer
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.fused_moe.runner.moe_runner_interface import MoERunnerInterface
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase

    from skyrl_isoexec.vllm import gdn, moe
    from skyrl_isoexec.vllm.attention import IsoExecAttentionImpl, IsoExecCPUAttentionImpl

    counts: dict[str, int] = dict(routed.get("op_modules", {}))
    patched: list[str] = list(routed.get("patched_modules", []))
    unpatched: list[str] = list(routed.get("unpatched", []))
    inside: list[str] = []  # a rotary or MoE module's own helpers are never called
    # Modules a canonical op stands for without calling them: a MoE's gate (its weight is the
    # router's GEMM, as the trainer's router computes it; a sibling of the experts in vLLM's block),
    # a GatedDeltaNet's conv1d (the canonical causal conv's taps) and its chunked delta-rule op.
    covered = {
        id(m.gate) for m in model.modules()
        if isinstance(m, MoERunnerInterface) and getattr(m, "gate", None) is not None and not moe.problems(m)
    } | {
        id(child) for m in model.modules()
        if isinstance(m, gdn.IsoExecQwenGatedDeltaNetAttention) and not gdn.problems(m)
        for child in (m.conv1d, getattr(m, "chunk_gated_delta_rule", None)) if child is not None
    }

    def count(*ops: str) -> None:
        for op in ops:
            counts[op] = counts.get(op, 0) + 1
        module._isoexec_name = qualname
        patched.append(qualname)

    for qualname, module in model.named_modules():
        name = f"{qualname or '<model>'} ({type(module).__name__})"
        if any(qualname.startswith(prefix + ".") for prefix in inside):
            continue
        if id(module) in covered:
            if getattr(module, "_skyrl_name", None) in patched:  # routed as a linear, never called as one
                patched.remove(module._skyrl_name)
                counts["linear"] -= 1
            continue
        if getattr(module, "_skyrl_name", None) is not None:  # routed by the op sites
            if isinstance(module, RotaryEmbeddingBase):
                inside.append(qualname)
            continue
        if name in unpatched:  # one the op sites could not route
            continue
        if isinstance(module, gdn.GatedDeltaNetAttention):
            reasons = gdn.problems(module)
            if reasons:
                unpatched.append(f"{name}: {'; '.join(reasons)}")
            else:
                count("gdn_conv", "gdn_core")
        elif isinstance(module, MoERunnerInterface):
            reasons = moe.problems(module)
            if reasons:
                unpatched.append(f"{name}: {'; '.join(reasons)}")
            else:
                count("moe_router", "moe_experts", "moe_combine")
                inside.append(qualname)  # its gate's weight is the router's; its experts' weights are read directly
        elif isinstance(module, Attention):
            impl = module.impl
            if isinstance(impl, IsoExecAttentionImpl) or (isinstance(impl, IsoExecCPUAttentionImpl) and impl._isoexec):
                count("attention")
            else:
                unpatched.append(f"{name} with {type(module.impl).__name__}")
        elif isinstance(module, LogitsProcessor):
            if module.soft_cap is not None or module.scale != 1.0 or module.logits_as_input:
                unpatched.append(f"{name} with soft cap {module.soft_cap} / scale {module.scale}")
        elif isinstance(module, (CustomOp, PluggableLayer)):
            unpatched.append(name)
        elif any(True for _ in module.parameters(recurse=False)):
            unpatched.append(name)
    return dict(sorted(counts.items())), sorted(patched), unpatched


def fused_linears(model: Any) -> dict[str, list[int]]:
    """Routed merged linears (q/k/v, gate/up) of ``model`` that run as one GEMM: name -> logical
    piece widths (the canonical linear's columns are independent: ``columns_independent``)."""
    fused = {}
    for module in model.modules():
        sizes = [int(n) for n in getattr(module, "output_partition_sizes", ()) or ()]
        if len(sizes) > 1 and len(getattr(module, "_skyrl_pieces", ())) == 1:
            fused[module._skyrl_name] = sizes
    return dict(sorted(fused.items()))


def prepacked_linears(model: Any) -> list[str]:
    """Routed linears (and lm_head) of ``model`` computing from a weight prepacked for oneDNN."""
    return sorted(module._skyrl_name for module in model.modules() if getattr(module, "_skyrl_packed", None) is not None)
