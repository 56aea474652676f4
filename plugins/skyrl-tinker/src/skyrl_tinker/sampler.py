"""Sampling for the Tinker server: an ``InferenceEngine`` (by registered name, default skyrl-torch)
over the same base model directory, loaded with an adapter's merged weights on demand.

The engine holds one set of weights at a time; a request for other weights (another sampler
checkpoint, or the base model) first pushes them with ``update_weights``: the merged weights of the
adapter's modules (``skyrl_core.lora.merged_weights``, the merge the trainer's ``forward`` uses)
or, for the base model, the original weights of every module an earlier adapter changed.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import torch

from skyrl_core import lora
from skyrl_core.config.schema import ModelConfig
from skyrl_core.types import GenerationRequest


def engine_options(name: str, options: dict[str, Any]) -> Any:
    """``options`` checked by engine ``name``'s options class (a clear error naming the key)."""
    from skyrl_core.config.loader import structure_options
    from skyrl_core.plugins.manager import get_plugin_manager

    return structure_options(get_plugin_manager().spec("inference_engine", name), options, path="engine.options")


def kv_budget(name: str, model_dir: str, options: dict[str, Any] | None = None, *, dtype: str = "float32") -> Any:
    """The KV-cache byte budget engine ``name`` would have over ``model_dir``, for an engine that
    sizes its cache by one and cannot preempt (skyrl-torch's ``kv_budget_of``: a ``KVBudget``, whose
    ``refusal(length)`` says why one sample of that many tokens cannot run); None for the others."""
    from skyrl_core.plugins.manager import get_plugin_manager

    budget_of = getattr(get_plugin_manager().spec("inference_engine", name).load_factory(), "kv_budget_of", None)
    return None if budget_of is None else budget_of(ModelConfig(path=model_dir, dtype=dtype), engine_options(name, options or {}))


def build_engine(name: str, model_dir: str, options: dict[str, Any] | None = None, seed: int = 0, *, dtype: str = "float32") -> Any:
    """Engine ``name`` over ``model_dir`` computing in ``dtype`` (the trainer's base model's)."""
    from skyrl_core.plugins.manager import get_plugin_manager

    spec = get_plugin_manager().spec("inference_engine", name)
    return spec.load_factory()(ModelConfig(path=model_dir, dtype=dtype), engine_options(name, options or {}), seed=seed)


_PARTIAL = "(a load that did not finish)"  # never a checkpoint path, nor None (the base model)
# A load touching fewer base-weight elements than this runs on one thread: its products are tiny,
# and a parallel region only waits for the second core, which the client may hold (a tiny model's
# merge took 3 ms, or 10-30 ms in about one save of four with two threads; never over 6 ms on one).
ONE_THREAD_BELOW_ELEMENTS = 1 << 22


class Sampler:
    def __init__(self, engine: Any, *, full_sets: bool = False, rests: bool = False) -> None:
        self.engine = engine
        # vLLM reloads weights layer by layer and wants every tensor of a layer (a full set);
        # skyrl-torch copies tensors in place, so only the changed modules are sent.
        self.full_sets = full_sets
        # skyrl-torch's sleep drops its KV cache and packed weight copies and its wake packs the
        # current weights once, which a weight update does anyway: so it sleeps while the trainer
        # needs the memory.
        self.rests = rests
        self.awake = True
        self.loaded: str | None = None  # key of the weights in the engine; None: base model
        self.changed: set[str] = set()  # weight names that currently differ from the base

    def rest(self) -> None:
        """Free the engine's generation memory while the trainer works (engines that rest)."""
        if self.rests and self.awake:
            self.engine.sleep()
            self.awake = False

    def ready(self) -> None:
        if not self.awake:
            self.engine.wake()
            self.awake = True

    def load(self, key: str | None, tensors: dict[str, torch.Tensor] | None, base: dict[str, torch.Tensor]) -> None:
        """Make the engine compute with ``tensors`` merged into ``base`` (weight name -> the base
        model's tensor: the adapted modules', or every weight with ``full_sets``) or, for None, the
        base model; ``key`` names those weights."""
        if key == self.loaded:
            return
        names = set(lora.adapted_weight_names(tensors)) if tensors else set()
        merged = lora.merged_weights(base, tensors) if tensors else iter(())
        # Until the update is whole, the engine holds some mix of the old and new weights: a load
        # that fails midway leaves no key, and every weight either touched is restored or merged
        # by the next load.
        self.loaded, self.changed = _PARTIAL, self.changed | names
        threads = torch.get_num_threads()
        small = sum(base[n].numel() for n in self.changed if n in base) < ONE_THREAD_BELOW_ELEMENTS
        if small and threads > 1:
            torch.set_num_threads(1)
        try:
            if self.full_sets:
                self.engine.update_weights(list({**base, **dict(merged)}.items()))
            else:
                # (merged one module at a time as the engine copies them in: never a whole merged model)
                restore = [(n, base[n]) for n in sorted(self.changed - names)]
                self.engine.update_weights(itertools.chain(restore, merged))
        finally:
            if small and threads > 1:
                torch.set_num_threads(threads)
        self.changed = names
        self.loaded = key

    def sample(self, requests: Sequence[GenerationRequest]) -> list[list[tuple[str, tuple[int, ...], tuple[float, ...]]]]:
        """One engine call for all ``requests``; per request, its samples as (stop reason, token
        ids, logprobs)."""
        return [[(s.stop_reason, s.token_ids, s.logprobs) for s in samples] for samples in self.engine.generate(list(requests))]

    def close(self) -> None:
        self.engine.close()
