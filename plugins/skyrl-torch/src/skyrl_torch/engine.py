"""The native inference engine: any Hugging Face causal LM, KV-cache slots, continuous batching.

How a ``generate`` call runs:

- Every sample gets a *slot* of a ``SlotKVCache``; at most ``max_num_seqs`` samples are in flight.
  Samples of a request are admitted together (as many as there are free slots): their prompt is
  prefilled once, in the first sample's slot, and the cached keys/values are copied to the others.
  Prompts admitted together that start with the same tokens (a chat template's system prompt)
  have that common prefix prefilled once too. Prefill forwards take ``PREFILL_TOKENS`` padded
  tokens at most (a longer prompt goes alone).
- The cache holds slots x (the longest request in them + 1) positions of every attention layer's
  keys and values, and never takes more than ``kv_cache_memory_bytes`` (``KVBudget``): waiting
  samples are admitted in arrival order while the cache that holds them fits; the first that does
  not waits for samples in flight to finish (the cache may then shrink: in-flight samples move
  down to the lowest slots first). A request one sample of which cannot fit alone is refused.
- Each decode step feeds the last token of every in-flight sample in one forward of the model
  (the model's own modules, with the slot cache passed as ``past_key_values`` and a 4D mask), then
  picks every next token at once. Finished samples free their slot and waiting ones take it.
- The logprob of each chosen token is the raw model distribution's (no temperature, no filter),
  computed by ``skyrl_core.ops.token_logprobs`` inside the ``engine_prefill`` / ``engine_decode``
  op sites.
- ``pause`` parks the driver between two decode steps; ``update_weights`` copies the new weights in
  place; ``recompute_kv`` then has the driver prefill every admitted sample's context (prompt and
  chosen tokens) into its slot again before the next step, so the tokens after the update see only
  keys/values of the new weights (``trainer.fully_async.kv_on_update: recompute``).

Hybrid decoders (``layer_types`` mixing ``full_attention`` and ``linear_attention``: Qwen3-Next's
GatedDeltaNet layers) run through the model's own modules with the same scheduler: each slot also
holds the linear-attention layers' conv and recurrent state (``SlotKVCache``), copied to the other
samples of a request after its prefill and moved with a sample when the batch is compacted.
Prefills always start at position 0 (the state of a left-padded continuation would see the padding),
so the shared-prefix prefill is off for these models; n samples still share one prefill.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import threading
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import attrs
import torch

from skyrl_core.compute_share import trainer_computing
from skyrl_core.engines.requests import check_request
from skyrl_core.heap import keep_freed_memory, release_freed_memory
from skyrl_core.lora import ties_unembedding
from skyrl_core.models import load_causal_lm, load_tokenizer, tied_aliases
from skyrl_core.ops import prepare_model, site_scope, token_logprobs
from skyrl_core.ops.onednn import computes as onednn_computes
from skyrl_core.openmp_teams import release_thread_team
from skyrl_core.trainer.memory_estimate import machine_memory_bytes
from skyrl_core.types import GeneratedSample, GenerationRequest
from skyrl_torch.installed_ops_decoder import InstalledOpsDecoder, missing_ops
from skyrl_torch.kv_cache import KVBudget, SlotKVCache, slot_capacity
from skyrl_torch.native_decoder import NativeDecoder, unsupported_reason
from skyrl_torch.options import TorchEngineOptions
from skyrl_torch.sampling import RowSampling, choose_tokens, sample_seed

if TYPE_CHECKING:
    from skyrl_core.config.schema import ModelConfig

# Padded tokens per prefill forward (admitted prompts, recompute_kv's contexts), at most: a bound
# on its activations, [n, q, kv] mask and attention scores. A longer prompt still goes in one forward.
PREFILL_TOKENS = 8192
# Uniform numbers a sample draws from its generator at once (a sample's stream is the same however
# it is split: CPU ``rand`` fills a tensor serially). One draw per token was 64 tiny ``rand`` calls
# a decode step at batch 64: up to 11% of a tiny model's generate (docs/benchmarks.md).
UNIFORMS_PER_DRAW = 32


@attrs.define(eq=False)
class _Ticket:
    """One ``generate`` call's samples still running, and the error that ended them, if any."""

    remaining: int
    error: BaseException | None = None


@attrs.define(eq=False)
class _Sample:
    """One continuation being generated."""

    request: GenerationRequest
    index: int
    generator: torch.Generator | None  # None for greedy samples (they draw nothing)
    stop_ids: frozenset[int]
    ticket: _Ticket
    slot: int = -1
    token_ids: list[int] = attrs.field(factory=list)
    logprobs: list[float] = attrs.field(factory=list)
    versions: list[int] = attrs.field(factory=list)  # the policy version that chose each token
    stop_reason: str | None = None
    text_end: int | None = None  # where a stop string starts in the decoded text
    text_checked: int = 0  # length of the decoded text already searched for stop strings
    uniforms: list[float] = attrs.field(factory=list)  # drawn ahead from the generator, next one last

    def next_uniform(self) -> float:
        """The next number of this sample's uniform stream (0.0 for a greedy sample, which draws none)."""
        if self.generator is None:
            return 0.0
        if not self.uniforms:
            ahead = min(UNIFORMS_PER_DRAW, max(1, self.request.sampling.max_tokens - len(self.token_ids)))
            self.uniforms = torch.rand((ahead,), generator=self.generator, dtype=torch.float64).tolist()[::-1]
        return self.uniforms.pop()

    @property
    def next_position(self) -> int:
        """Position of the last chosen token, the one the next decode step feeds."""
        return len(self.request.prompt_token_ids) + len(self.token_ids) - 1


class TorchEngine:
    """``skyrl_core.interfaces.InferenceEngine`` in plain PyTorch over a transformers model."""

    supports_pause = True  # pause/resume keep in-flight samples and their KV cache
    supports_kv_recompute = True  # recompute_kv: paused samples re-prefill under the new weights
    supports_separate_process = True  # runs inside a Ray actor (engine.placement: separate)

    def __init__(self, model: ModelConfig, options: TorchEngineOptions | None = None, *, seed: int = 0) -> None:
        self.options = options if options is not None else TorchEngineOptions()
        self.seed = seed
        keep_freed_memory()  # per-step logits and activations reuse heap blocks (skyrl_core.heap)
        self.model = load_causal_lm(model, seed=seed, device=self.options.device)
        self.tokenizer = load_tokenizer(model)
        config = self.model.config.get_text_config()
        layer_types = list(getattr(config, "layer_types", None) or ["full_attention"])
        unknown = set(layer_types) - {"full_attention", "linear_attention"}
        if unknown:
            raise NotImplementedError(
                "skyrl-torch runs decoders of full-attention and linear-attention (GatedDeltaNet) layers; "
                f"this model also has layer types {sorted(unknown)}"
            )
        # Indices of the layers that keep a recurrent state instead of keys/values.
        self.linear_layers = tuple(i for i, t in enumerate(layer_types) if t == "linear_attention")
        if self.options.attention != "model":
            self.model.set_attn_implementation(self.options.attention)
        self.model.requires_grad_(False)
        self.ledger = prepare_model(self.model, "engine")
        self.native = self._native_decoder()
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.macs_per_token = _weights_per_token(self.model)
        self.max_model_len = self.options.max_model_len or int(getattr(config, "max_position_embeddings", 2048))
        self.kv_budget = KVBudget.of(config, self.model.dtype, _kv_cache_limit(self.options))
        self.eos_ids = self._eos_ids()
        self._cache: SlotKVCache | None = None
        self._unseeded = itertools.count()
        self._params = dict(self.model.named_parameters(remove_duplicate=False))
        self._tied = tied_aliases(self.model)  # second names of tied tensors
        self._buffers = dict(self.model.named_buffers(remove_duplicate=False))
        self._closed = False
        self._unpacked_asleep = False  # sleep dropped the prepacked weight copies; wake renews them
        # Continuous batching across concurrent ``generate`` calls: one scheduler state, driven by
        # one caller at a time (the others wait; the driver hands over when its own samples are done).
        self.policy_version = 0  # stamped on every token chosen; set by update_weights
        self._lock = threading.Condition()
        self._waiting: collections.deque[list[_Sample]] = collections.deque()  # groups without slots
        self._active: dict[int, _Sample] = {}  # slot -> sample being decoded
        self._free: list[int] = []  # free slots (a heap)
        self._layout: tuple[RowSampling, list[int]] | None = None
        self._driver: int | None = None  # thread driving the scheduler
        self._pause_requested = False
        self._parked = False  # the driver stopped at a token boundary for a pause
        self._kv_stale = False  # recompute_kv was called: re-prefill the active samples before their next token

    @classmethod
    def kv_budget_of(cls, model: ModelConfig, options: TorchEngineOptions | None = None) -> KVBudget:
        """The ``kv_budget`` of an engine of ``model`` and ``options``, from the model's config alone
        (no weights loaded): a server refuses what cannot fit before it joins a batch."""
        from transformers import AutoConfig

        from skyrl_core.models import build_hf_config, torch_dtype

        options = options if options is not None else TorchEngineOptions()
        config = AutoConfig.from_pretrained(model.path) if model.path is not None else build_hf_config(model.config)
        return KVBudget.of(config.get_text_config(), torch_dtype(model.dtype), _kv_cache_limit(options))

    # -- InferenceEngine -----------------------------------------------------------------------

    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[GeneratedSample]]:
        """Thread-safe: concurrent calls are batched together (continuous batching)."""
        self._check_open()
        for request in requests:
            self._validate(request)
        ticket = _Ticket(remaining=sum(r.sampling.n for r in requests))
        samples = [self._new_samples(r, ticket) for r in requests]
        if ticket.remaining == 0:
            return []
        me = threading.get_ident()
        with self._lock:
            self._waiting.extend(samples)
            while ticket.remaining and ticket.error is None and self._driver is not None:
                self._lock.wait()
            if ticket.remaining and ticket.error is None:
                self._driver = me
        if self._driver == me:
            self._drive(ticket)
        if ticket.error is not None:
            raise RuntimeError(f"generation failed: {ticket.error}") from ticket.error
        unfinished = [s.request.request_id for group in samples for s in group if s.stop_reason is None]
        if unfinished:  # a scheduler bug, never returned as samples cut short
            raise RuntimeError(f"generation ended with unfinished samples of requests {sorted(set(unfinished))}")
        return [[self._finish(s) for s in group] for group in samples]

    def pause(self) -> None:
        """Stop every in-flight sample at a token boundary, keeping its KV cache slot; return once
        stopped. ``generate`` calls block meanwhile (new ones too) and continue after ``resume``."""
        self._check_open()
        with self._lock:
            self._pause_requested = True
            while self._driver is not None and not self._parked:
                self._lock.wait()

    def resume(self) -> None:
        """Continue the samples ``pause`` stopped, under the weights loaded meanwhile."""
        with self._lock:
            self._pause_requested = False
            self._lock.notify_all()

    def recompute_kv(self) -> None:
        """Drop the keys/values of every admitted sample: before its next token, each is prefilled
        again from its prompt and chosen tokens under the weights loaded then (call while paused,
        after ``update_weights``). Samples still waiting are prefilled under those weights anyway;
        this engine keeps no prefix cache across steps."""
        self._check_open()
        with self._lock:
            self._kv_stale = True

    def in_flight(self) -> dict[tuple[str, int], int]:
        """Tokens chosen so far by each unfinished sample (admitted or waiting), by (request id, sample index)."""
        with self._lock:
            samples = [*self._active.values(), *itertools.chain.from_iterable(self._waiting)]
            return {(s.request.request_id, s.index): len(s.token_ids) for s in samples}

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        """Copy each tensor into the parameter or buffer of that Hugging Face name, in place; tokens
        chosen afterwards carry policy version ``version`` (``None``: the current version + 1).

        A tensor under several names (a tied unembedding: ``lm_head.weight`` is
        ``model.embed_tokens.weight``) takes a value given for its first name, the one a checkpoint
        of the tied model keeps, under every name. A later name given the values the tensor holds
        is skipped (a full set names it twice); given other values (a LoRA adapter merged into
        ``lm_head`` alone) it gets a tensor of its own and the first name keeps its values.

        Raises ``KeyError`` for a name the model does not have and ``ValueError`` for a shape that
        differs; tensors before the bad one are already loaded. While generation runs, the engine
        is paused around the update (unless already paused): in-flight samples keep their keys/values
        (computed by the old weights; ``recompute_kv`` recomputes them) and continue under the new ones.
        """
        self._check_open()
        was_paused = self._pause_requested
        if not was_paused:
            self.pause()
        try:
            self._load(named_tensors)
            self.policy_version = self.policy_version + 1 if version is None else int(version)
        finally:
            if not was_paused:
                self.resume()

    def _load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        try:
            with torch.no_grad():
                for name, tensor in named_tensors:
                    target = self._params.get(name)
                    if target is None:
                        target = self._buffers.get(name)
                    if target is None:
                        similar = [n for n in self._params if n.endswith(name.split(".")[-1])] or list(self._params)
                        raise KeyError(
                            f"update_weights: the model has no parameter or buffer {name!r}; it has e.g. {', '.join(similar[:3])}"
                        )
                    if tuple(tensor.shape) != tuple(target.shape):
                        raise ValueError(
                            f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}"
                        )
                    if name in self._tied:
                        if torch.equal(tensor.to(target.dtype), target):
                            continue  # (a full set names a tied tensor twice: the first copy did it)
                        self._untie(name, tensor)
                        continue
                    target.copy_(tensor)
        finally:  # also after a refused tensor: the ones before it are loaded
            if self.native is not None and not self._unpacked_asleep:  # asleep: wake packs the new weights
                self.native.repack()  # its prepacked GEMM operands are copies of the old weights

    def _untie(self, name: str, tensor: torch.Tensor) -> None:
        """Give parameter ``name`` (one of several names of one tensor: a tied unembedding) a tensor
        of its own holding ``tensor``'s values; the other names keep theirs. An update giving a
        tied name other values than its partners means that name alone (an adapter merged into
        ``lm_head`` only, ``skyrl_core.lora``); copying into the shared tensor would change the
        embedding too."""
        module_name, _, attribute = name.rpartition(".")
        module = self.model.get_submodule(module_name)
        own = torch.nn.Parameter(tensor.to(self._params[name].dtype).clone(), requires_grad=False)
        setattr(module, attribute, own)
        self._params[name] = own
        self._tied = tied_aliases(self.model)
        config = self.model.config
        if getattr(config, "tie_word_embeddings", False):  # (so that nothing re-ties them later)
            config.tie_word_embeddings = False

    def execution_contract(self) -> dict[str, Any]:
        return {
            "ledger": self.ledger.as_dict(),
            "model_dtype": str(self.model.dtype).removeprefix("torch."),
            "implementation": self._implementation_name(),
            "gemm": self.native.gemm if isinstance(self.native, NativeDecoder) else "torch",
            "prepacked_gemm_operands": 0 if self.native is None else self.native.prepacked,
            "torch": torch.__version__,
        }

    def sleep(self) -> None:
        """Drop the KV cache (reallocated by the next ``generate``) and the prepacked copies of the
        weights (renewed by ``wake``); the weights stay."""
        self._check_open()
        with self._lock:
            if self._active or self._waiting:
                raise RuntimeError("sleep: samples are in flight (paused or generating); their KV cache must stay")
            self._cache = None
            if self.native is not None and self.native.prepacked:
                self.native.unpack()
                self._unpacked_asleep = True
        release_freed_memory()  # the freed blocks go back to the OS now, not at the next trim

    def wake(self) -> None:
        self._check_open()
        with self._lock:
            if self._unpacked_asleep:
                self.native.repack()
                self._unpacked_asleep = False

    def close(self) -> None:
        self._cache = None
        self._params = {}
        self._buffers = {}
        self.model = None
        self.native = None
        self._closed = True

    # -- the scheduler -------------------------------------------------------------------------

    def _drive(self, ticket: _Ticket) -> None:
        """Run the scheduler (for every caller's samples) until this caller's samples are done,
        stopping at token boundaries while a pause is requested; then hand over."""
        # (per thread with OpenMP: another thread's setting, the trainer's, is left alone)
        caller_threads = torch.get_num_threads()
        own_threads = self.options.threads if self.options.threads is not None else caller_threads
        beside_training = self.options.threads_beside_training
        if own_threads != caller_threads:
            torch.set_num_threads(own_threads)
        admitted: list[list[_Sample]] = []  # between the scheduler's lists: neither waiting nor active
        try:
            with torch.inference_mode():
                while True:
                    with self._lock:
                        while self._pause_requested:
                            self._parked = True
                            self._lock.notify_all()
                            self._lock.wait()
                        self._parked = False
                        if not ticket.remaining:
                            return  # (a pending recompute_kv is left to the next driver)
                        stale = list(self._active.values()) if self._kv_stale else []
                        self._kv_stale = False
                        admitted = self._admit()
                    if stale:
                        self._recompute_kv(stale)
                    # Per step: the trainer may have started or stopped, and the step's size changes.
                    threads = beside_training if beside_training is not None and trainer_computing() else own_threads
                    if threads > 1 and self._step_macs(admitted) < self.options.one_thread_below_macs:
                        threads = 1
                    if torch.get_num_threads() != threads:
                        torch.set_num_threads(threads)
                    self._iterate(admitted)
        except BaseException as exc:  # every sample in flight is lost with the cache's state
            with self._lock:
                in_flight = [*self._active.values(), *itertools.chain.from_iterable(self._waiting),
                             *itertools.chain.from_iterable(admitted)]  # admitted: a prefill that raised
                for s in in_flight:
                    s.ticket.error = exc
                self._active.clear()
                self._waiting.clear()
                self._cache, self._free, self._layout = None, [], None
            # This caller's samples were unfinished (it drives until they are done): it gets the
            # error itself, never samples cut short. The other callers get it through their tickets.
            ticket.error = None
            raise
        finally:
            if torch.get_num_threads() != caller_threads:
                torch.set_num_threads(caller_threads)
            # The next driver may be another thread (a joining caller, another rollout worker): this
            # one's OpenMP team, idle from now on, would slow its team down (skyrl_core.openmp_teams).
            release_thread_team()
            with self._lock:
                self._driver = None
                self._parked = False
                self._lock.notify_all()

    def _admit(self) -> list[list[_Sample]]:
        """Give slots to waiting samples, in arrival order, as many as ``max_num_seqs`` and the KV
        budget allow (resizing the cache as they need); under the lock."""
        if not self._waiting:
            return []
        waiting = [s for g in self._waiting for s in g]
        active = list(self._active.values())
        longest = max(_length(s) for s in (*active, *waiting))
        num_slots = min(len(active) + len(waiting), self.options.max_num_seqs)
        admissible = len(waiting)
        if self.kv_budget.fits(*self._covering(num_slots, longest)):
            self._ensure_cache(num_slots, longest)
        else:
            # Within the budget: the first samples waiting whose cache fits, counting the slots in
            # use only (in-flight samples can move down to the lowest slots).
            admissible, longest = self._admissible(active, waiting)
            if not admissible:
                if not active:  # (_validate refuses such a request: it would wait forever)
                    raise RuntimeError(f"request {waiting[0].request.request_id!r} does not fit kv_cache_memory_bytes even alone")
                return []  # the first waits for samples in flight to finish
            num_slots = len(active) + admissible
            if self.kv_budget.fits(*self._covering(num_slots, longest)):
                self._ensure_cache(num_slots, longest)  # (growing in place, if at all)
            else:
                self._resize_cache(num_slots, slot_capacity(longest))
        admitted: list[list[_Sample]] = []
        while self._waiting and self._free and admissible:
            group = self._waiting.popleft()
            room = min(len(self._free), admissible)
            take, rest = group[:room], group[room:]
            if rest:
                self._waiting.appendleft(rest)
            for s in take:
                s.slot = heapq.heappop(self._free)
            admissible -= len(take)
            admitted.append(take)
        return admitted

    def _admissible(self, active: list[_Sample], waiting: list[_Sample]) -> tuple[int, int]:
        """How many of the first ``waiting`` samples a cache within the budget holds beside the
        ``active`` ones (one slot each, all of the longest one's capacity), and that length."""
        longest = max((_length(s) for s in active), default=0)
        count = 0
        for s in waiting[: self.options.max_num_seqs - len(active)]:
            length = max(longest, _length(s))
            if not self.kv_budget.fits(len(active) + count + 1, slot_capacity(length)):
                break
            count, longest = count + 1, length
        return count, longest

    def _step_macs(self, admitted: list[list[_Sample]]) -> int:
        """Multiply-adds of the next step's weight products: each admitted group's prompt prefilled
        once, then one token for every active and admitted sample."""
        prompts = sum(len(g[0].request.prompt_token_ids) for g in admitted)
        rows = len(self._active) + sum(len(g) for g in admitted)
        return (prompts + rows) * self.macs_per_token

    def _iterate(self, admitted: list[list[_Sample]]) -> None:
        """Prefill the admitted samples, then one decode step for every active sample."""
        cache, active, free = self._cache, self._active, self._free
        done: list[_Sample] = []
        if admitted:
            self._prefill(admitted, cache)
            for s in itertools.chain.from_iterable(admitted):
                if s.stop_reason is None:
                    active[s.slot] = s
                else:
                    done.append(s)
            self._layout = None
        if active:
            if self._layout is None:
                slots = sorted(active)
                self._layout = (self._row_sampling([active[i] for i in slots]), slots)
            done += self._decode_step(active, self._layout, cache)
        with self._lock:
            for s in done:
                active.pop(s.slot, None)
                heapq.heappush(free, s.slot)
                s.ticket.remaining -= 1
            if done:
                self._layout = None
                if not self._waiting:  # (waiting samples refill the holes instead)
                    self._compact(active, free, cache)
                self._lock.notify_all()

    @staticmethod
    def _compact(active: dict[int, _Sample], free: list[int], cache: SlotKVCache) -> None:
        """Move the highest in-flight samples down into free slots: a decode step spans slots
        0..highest in flight, so holes below it would be computed for nothing."""
        while free and active:
            top = max(active)
            if free[0] > top:
                return
            hole = heapq.heappop(free)
            s = active.pop(top)
            cache.copy_prefix(top, [hole], s.next_position)  # every cached token of the sample
            s.slot = hole
            active[hole] = s
            heapq.heappush(free, top)

    def _prefill(self, groups: list[list[_Sample]], cache: SlotKVCache) -> None:
        """Prefill the prompt of each group once, share it with the group's samples, pick first tokens."""
        prompts = [g[0].request.prompt_token_ids for g in groups]
        primaries = [g[0].slot for g in groups]
        start = 0
        if len(groups) > 1 and self.options.shared_prefix_min_tokens > 0 and not self.linear_layers:
            shared = min(_common_prefix_len(prompts), min(len(p) for p in prompts) - 1)
            if shared >= self.options.shared_prefix_min_tokens:
                with site_scope("engine_prefill"):
                    self._forward(cache, [primaries[0]], [prompts[0][:shared]], start=0)
                cache.copy_prefix(primaries[0], primaries[1:], shared)  # every group's, whichever forward it goes in
                start = shared
        suffixes = [p[start:] for p in prompts]
        with site_scope("engine_prefill"):
            logits = torch.cat([
                self._forward(cache, [primaries[i] for i in batch], [suffixes[i] for i in batch], start=start)
                for batch in _prefill_batches([len(t) for t in suffixes])
            ])
            for g, p in zip(groups, prompts):
                cache.copy_prefix(g[0].slot, [s.slot for s in g[1:]], len(p))
            flat = [s for g in groups for s in g]
            rows = torch.tensor([i for i, g in enumerate(groups) for _ in g], device=logits.device)
            self._choose(logits[rows], flat, self._row_sampling(flat))

    def _recompute_kv(self, samples: list[_Sample]) -> None:
        """Prefill each sample's context into its slot again, from position 0 under the current
        weights: its prompt and every chosen token but the last (which the next decode step feeds).
        The logits go unused. Rows of similar length go together, at most ``PREFILL_TOKENS``
        padded tokens a forward (IsoExec's prefill is batch-invariant: the grouping changes no bit)."""
        cache = self._cache
        batch: list[_Sample] = []
        with site_scope("engine_prefill"):
            for s in sorted(samples, key=lambda s: s.next_position):
                if batch and (len(batch) + 1) * s.next_position > PREFILL_TOKENS:
                    self._forward(cache, [b.slot for b in batch], [_context(b) for b in batch], start=0)
                    batch = []
                batch.append(s)
            if batch:
                self._forward(cache, [b.slot for b in batch], [_context(b) for b in batch], start=0)

    def _decode_step(
        self, active: dict[int, _Sample], layout: tuple[RowSampling, list[int]], cache: SlotKVCache
    ) -> list[_Sample]:
        """One token for every active sample, in one forward over slots ``0..max active slot``."""
        row_sampling, slots = layout
        width = slots[-1] + 1
        tokens = [0] * width
        positions = [-1] * width  # idle slots in range compute padding that nobody reads
        for slot in slots:
            s = active[slot]
            tokens[slot] = s.token_ids[-1]
            positions[slot] = s.next_position
        device = cache.device
        with site_scope("engine_decode"):
            logits = self._forward_rows(
                cache,
                torch.arange(width, device=device),
                torch.tensor(tokens, device=device).unsqueeze(1),
                torch.tensor(positions, device=device).unsqueeze(1),
                contiguous=True,
            )
            if len(slots) != width:
                logits = logits[torch.tensor(slots, device=device)]
            ordered = [active[i] for i in slots]
            self._choose(logits, ordered, row_sampling)
        return [s for s in ordered if s.stop_reason is not None]

    def _forward(self, cache: SlotKVCache, slots: list[int], token_lists: list[Sequence[int]], *, start: int) -> torch.Tensor:
        """Feed ``token_lists[i]`` (positions ``start..``) to slot ``slots[i]``; last-token logits ``[n, V]``.

        Rows are left-padded so that every row's last token is the last column.
        """
        width = max(len(t) for t in token_lists)
        tokens = torch.zeros(len(token_lists), width, dtype=torch.long)
        positions = torch.full((len(token_lists), width), -1, dtype=torch.long)
        for i, toks in enumerate(token_lists):
            tokens[i, width - len(toks) :] = torch.tensor(toks, dtype=torch.long)
            positions[i, width - len(toks) :] = torch.arange(start, start + len(toks))
        device = cache.device
        return self._forward_rows(
            cache, torch.tensor(slots, device=device), tokens.to(device), positions.to(device), fresh=start == 0
        )

    def _forward_rows(
        self,
        cache: SlotKVCache,
        rows: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        *,
        contiguous: bool = False,
        fresh: bool = False,
    ) -> torch.Tensor:
        mask = cache.plan(rows, positions, contiguous=contiguous, fresh=fresh)
        if self.native is not None and not _tapped(self.model):
            return self.native.forward(cache, tokens, positions, mask)
        if self.linear_layers:
            # Attention layers take the slot mask; linear-attention layers zero the inputs of
            # padding tokens (the 2D mask transformers' own masking would give them).
            padding = None
            if tokens.shape[1] > 1 and bool((positions < 0).any()):
                padding = (positions >= 0).long()
            mask = {"full_attention": mask, "linear_attention": padding}
        out = self.model(
            input_ids=tokens,
            attention_mask=mask,
            position_ids=positions.clamp(min=0),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1]

    def _choose(self, logits: torch.Tensor, samples: list[_Sample], rows: RowSampling) -> None:
        """Pick each sample's next token from its row of ``logits``, record it and its raw logprob."""
        uniforms = torch.tensor([s.next_uniform() for s in samples], dtype=torch.float64, device=logits.device)
        chosen = choose_tokens(logits, rows, uniforms)
        logprobs = token_logprobs(logits, chosen, ledger=self.ledger)
        for s, token, logprob in zip(samples, chosen.tolist(), logprobs.tolist()):
            s.token_ids.append(token)
            s.logprobs.append(logprob)
            s.versions.append(self.policy_version)
            self._check_stop(s)

    def _check_stop(self, s: _Sample) -> None:
        sampling = s.request.sampling
        if s.token_ids[-1] in s.stop_ids:
            s.stop_reason = "stop"
            return
        if sampling.stop:
            text = self.tokenizer.decode(s.token_ids, skip_special_tokens=True)
            # A new match ends in the text this token added; earlier matches would have stopped
            # an earlier step. One character of slack for tokenizers that re-space the text.
            found = [i for i in (text.find(stop, max(0, s.text_checked - len(stop))) for stop in sampling.stop) if i >= 0]
            s.text_checked = len(text)
            if found:
                s.stop_reason = "stop"
                s.text_end = min(found)
                return
        if len(s.token_ids) >= sampling.max_tokens:
            s.stop_reason = "length"

    def _finish(self, s: _Sample) -> GeneratedSample:
        text = self.tokenizer.decode(s.token_ids, skip_special_tokens=True)
        if s.text_end is not None:
            text = text[: s.text_end]
        return GeneratedSample(
            request_id=s.request.request_id,
            sample_index=s.index,
            prompt_token_ids=s.request.prompt_token_ids,
            token_ids=s.token_ids,
            logprobs=s.logprobs,
            text=text,
            stop_reason=s.stop_reason,
            token_versions=s.versions,
        )

    # -- helpers -------------------------------------------------------------------------------

    def _new_samples(self, request: GenerationRequest, ticket: _Ticket) -> list[_Sample]:
        sampling = request.sampling
        seed = sampling.seed if sampling.seed is not None else sample_seed(self.seed, (1 << 40) + next(self._unseeded))
        stop_ids = frozenset(self.eos_ids) | frozenset(sampling.stop_token_ids)
        out = []
        for index in range(sampling.n):
            generator = None
            if sampling.temperature > 0:
                generator = torch.Generator(device="cpu")
                generator.manual_seed(sample_seed(seed, index))
            out.append(_Sample(request=request, index=index, generator=generator, stop_ids=stop_ids, ticket=ticket))
        return out

    def _row_sampling(self, samples: list[_Sample]) -> RowSampling:
        return RowSampling(
            [s.request.sampling.temperature for s in samples],
            [s.request.sampling.top_p for s in samples],
            [s.request.sampling.top_k for s in samples],
            device=self._cache.device if self._cache is not None else torch.device("cpu"),
        )

    def _covering(self, num_slots: int, length: int) -> tuple[int, int]:
        """The (slots, capacity) of the cache ``_ensure_cache(num_slots, length)`` leaves: it never shrinks."""
        capacity = slot_capacity(length)
        if self._cache is None:
            return num_slots, capacity
        return max(num_slots, self._cache.num_slots), max(capacity, self._cache.capacity)

    def _ensure_cache(self, num_slots: int, length: int) -> SlotKVCache:
        """A cache of at least ``num_slots`` slots for sequences of ``length`` tokens; ``self._free`` its free slots."""
        shape = self._covering(num_slots, length)
        if self._cache is None or (self._cache.num_slots, self._cache.capacity) != shape:
            self._resize_cache(*shape)
        return self._cache

    def _resize_cache(self, num_slots: int, capacity: int) -> None:
        """A cache of exactly this shape, the samples in flight continuing in it; to fewer slots,
        they first move down to the lowest (the shape must hold them: ``num_slots`` at least as many,
        ``capacity`` at least their lengths)."""
        cache = self._cache
        if not self._active:
            self._cache = None  # free the old one before allocating the new
            self._free = []
            self._cache = SlotKVCache(
                num_layers=self.model.config.get_text_config().num_hidden_layers,
                num_slots=num_slots,
                capacity=capacity,
                dtype=self.model.dtype,
                device=self.options.device,
                linear_layers=self.linear_layers,
            )
            self._free = list(range(num_slots))
            return
        if num_slots < cache.num_slots:
            self._compact(self._active, self._free, cache)
            self._layout = None
        self._cache = cache.resized(num_slots, capacity)
        self._free = [slot for slot in self._free if slot < num_slots] + list(range(cache.num_slots, num_slots))
        heapq.heapify(self._free)

    def _validate(self, request: GenerationRequest) -> None:
        check_request(request)
        where = f"request {request.request_id!r}"
        sp = request.sampling
        bad = [t for t in request.prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{where}: prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        length = len(request.prompt_token_ids) + sp.max_tokens
        if length > self.max_model_len:
            raise ValueError(
                f"{where}: prompt ({len(request.prompt_token_ids)} tokens) + max_tokens ({sp.max_tokens}) = {length} "
                f"exceeds max_model_len {self.max_model_len}"
            )
        too_long = self.kv_budget.refusal(length)
        if too_long is not None:  # (admitted alone it would still overflow the budget: it could never run)
            raise ValueError(f"{where}: {too_long}")

    def _native_decoder(self) -> NativeDecoder | InstalledOpsDecoder | None:
        """The lean forward when chosen and possible (over the installed ops when an op plugin
        installed any); ``None`` runs the model's own modules."""
        choice = self.options.implementation
        if choice == "transformers":
            return None
        reason = unsupported_reason(self.model)
        if reason is None and _stock_ops(self.ledger):
            # oneDNN where it computes the model's dtype here (bf16 needs AVX-512 or newer); a bf16 model
            # on an AVX2-only CPU multiplies in fp32 on oneDNN (PyTorch's bf16 GEMM is 5-50x slower there)
            gemm = "torch"
            if self.options.cpu_gemm == "onednn" and self.options.device == "cpu":
                if onednn_computes(self.model.dtype):
                    gemm = "onednn"
                elif self.model.dtype == torch.bfloat16 and onednn_computes(torch.float32):
                    gemm = "onednn_fp32"
            return NativeDecoder(self.model, gemm=gemm, prepack_weights=self.options.prepack_weights,
                                 torch_below_macs=self.options.torch_gemm_below_macs)
        if reason is None:
            missing = missing_ops(self.ledger)
            if not missing:
                return InstalledOpsDecoder(self.model, self.ledger, prepack_weights=self.options.prepack_weights)
            reason = f"an op plugin installed some ops but left stock ones at {', '.join(missing[:4])}"
        if choice == "native":
            raise ValueError(f"engine option implementation='native' is not possible for this model: {reason}")
        return None

    def _implementation_name(self) -> str:
        if isinstance(self.native, NativeDecoder):
            return "native"
        return "native, installed ops" if self.native is not None else "transformers"

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(self.tokenizer, "eos_token_id", None), getattr(self.model.generation_config, "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif source is not None:
                ids.update(int(i) for i in source)
        return ids

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this TorchEngine is closed")


def _weights_per_token(model: torch.nn.Module) -> int:
    """Multiply-adds of a token's weight products: every parameter but the input embeddings (a
    lookup), the output head counted even when tied to them."""
    total = sum(p.numel() for p in model.parameters())  # (a tied tensor once)
    tied_head = model.get_output_embeddings().weight.numel() if ties_unembedding(model) else 0
    return total - model.get_input_embeddings().weight.numel() + tied_head


def _length(s: _Sample) -> int:
    """Positions a sample's slot must hold: its prompt and every token it may choose."""
    return len(s.request.prompt_token_ids) + s.request.sampling.max_tokens


def _prefill_batches(widths: list[int]) -> list[list[int]]:
    """Consecutive rows (indices into ``widths``, their token counts) cut into forwards of at most
    ``PREFILL_TOKENS`` padded tokens each (a row that alone exceeds it goes alone)."""
    batches: list[list[int]] = []
    widest = 0
    for i, width in enumerate(widths):
        if batches and (len(batches[-1]) + 1) * max(widest, width) <= PREFILL_TOKENS:
            batches[-1].append(i)
            widest = max(widest, width)
        else:
            batches.append([i])
            widest = width
    return batches


def _kv_cache_limit(options: TorchEngineOptions) -> int:
    """``kv_cache_memory_bytes``, by default a quarter of the device's memory: the GPU's total, or
    on CPU this machine's physical memory (its cgroup's limit in a container, if smaller)."""
    if options.kv_cache_memory_bytes is not None:
        return options.kv_cache_memory_bytes
    if options.device == "cuda":
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    else:
        total = machine_memory_bytes()
    return total // 4


def _context(s: _Sample) -> list[int]:
    """The tokens whose keys/values a paused sample's slot holds: positions ``0..next_position - 1``."""
    return [*s.request.prompt_token_ids, *s.token_ids[:-1]]


def _tapped(model: Any) -> bool:
    """A debugging tap on the model's op dispatch sees only the patched modules' calls."""
    dispatch = getattr(model, "_skyrl_dispatch", None)
    return dispatch is not None and dispatch.tap is not None


def _stock_ops(ledger: Any) -> bool:
    from skyrl_core.ops.install import DEFAULT_IMPLS

    return all(impl.name == DEFAULT_IMPLS[op].name for (op, _site), impl in ledger.declared.items())


def _common_prefix_len(sequences: list[Sequence[int]]) -> int:
    first = sequences[0]
    n = min(len(s) for s in sequences)
    for i in range(n):
        t = first[i]
        if any(s[i] != t for s in sequences):
            return i
    return n
