"""``LoraTrainer``: one base model in this process, any number of LoRA adapters on it, each with its
own AdamW state. A Tinker "model" (training run) is one adapter.

The base model is loaded once and prepared for the ``trainer`` role through the core's op sites
(``skyrl_core.ops.prepare_model``), so an op plugin (IsoExec) reaches it exactly as it reaches the
FSDP rank. Adapters are peft LoRA layers (``skyrl_core.lora``); a computation selects one adapter,
so only its tensors get gradients and the others are untouched.

Every logprob that must match the sampler's is computed with the adapter *merged* into the base
weights (``skyrl_core.lora.merged_weight``, the merge the inference engine gets after
``save_weights_for_sampler``) and the LoRA layers off: ``forward`` and prompt logprobs always, and
``forward_backward`` when an op plugin (IsoExec) installs its own ops, with the merged weight
computed from the live A and B so that gradients reach them. With IsoExec on, a sampled token's
logprob and the trainer's are therefore the same bits. With stock ops ``forward_backward`` runs
the cheaper unmerged layers (``W x + s B A x``, ``skyrl_core.lora.fused_forward``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from typing import Any, Iterator, Sequence

import attrs
import numpy as np
import torch

from skyrl_core import lora
from skyrl_core.backends.activation_checkpointing import checkpointed_layers, decoder_layers
from skyrl_core.backends.gradients_on_failure import gradients_restored_on_failure
from skyrl_core.backends.packing import plan_group_passes
from skyrl_core.config.schema import ModelConfig
from skyrl_core.heap import keep_freed_memory, own_maps_above, release_freed_memory
from skyrl_core.models import load_causal_lm
from skyrl_core.ops import prepare_model, site_scope, token_logprobs
from skyrl_core.ops.chunked_logprobs import chunked_token_logprobs, output_head, with_final_hidden
from skyrl_core.ops.install import DEFAULT_IMPLS
from skyrl_core.ops.gemm_choice import CPU_GEMMS, linear_defaults
from skyrl_core.ops.shared_prompts import (
    model_allows_sharing,
    pack_rows,
    prefix_groups,
    prompt_sharing_allowed,
    run_packed,
    token_cost_in_pairs,
)
from skyrl_core.trainer.memory_estimate import machine_memory_bytes
from skyrl_tinker.losses import compute_loss

# The base model's dtypes (``skyrl tinker serve --dtype``).
DTYPES = ("float32", "bfloat16")
ADAPTER_FILE = "adapter.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
META_FILE = "adapter.json"
# Estimated memory of one forward/backward pass (padded positions x ``LoraTrainer.bytes_per_token``):
# a mini-batch is split where it would pass this. Fewer, larger passes are a little faster: a tiny
# model's 64-datum batch is one pass; SmolLM2's (576 wide, 30 layers) 64 RL samples of ~36 tokens
# ten (7 rows each), which keeps the server's peak near 3 GiB with two fp32 copies of the model.
MICRO_BATCH_BYTES = 1 << 30
# Bytes of fp32 logits (positions x vocabulary) that exist at once in a pass (``_logprobs``):
# SmolLM2's 49k vocabulary gives chunks of 341 positions, a tiny model's one chunk per pass.
LOGPROB_CHUNK_BYTES = 64 << 20
# Passes estimated at this size or more give the freed heap back to the OS afterwards.
RELEASE_AFTER_BYTES = 1 << 28
# A datum whose pass would take more than this share of the machine's memory runs with its decoder
# layers checkpointed (backward recomputes one layer at a time from its input)...
CHECKPOINT_ABOVE_MEMORY_SHARE = 0.25
# ... and one that would take more than this share even so is refused at submission
# (``max_train_tokens``).
PASS_MEMORY_SHARE = 0.5
# Long passes give allocations of this size or more their own memory maps (``skyrl_core.heap``).
LONG_PASS_MMAP_MIB = 32
# The training runs (adapters) of a server may hold at most this share of the machine's memory:
# the SDK has no call that unloads one, so they live until the server stops.
ADAPTER_MEMORY_SHARE = 0.25


@attrs.frozen
class Example:
    """One Tinker datum: input tokens and per-position loss inputs (``target_tokens`` and others),
    one value per token each (checked here: the trainer lays every input out by its datum's length)."""

    tokens: np.ndarray  # int64 [T]
    inputs: dict[str, np.ndarray]  # each [T]

    def __attrs_post_init__(self) -> None:
        for key, values in self.inputs.items():
            if len(values) != len(self.tokens):
                raise ValueError(f"Example: {key} has {len(values)} values for {len(self.tokens)} tokens")


@attrs.frozen
class AdamStep:
    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip_norm: float


@attrs.define
class Adapter:
    name: str
    rank: int
    alpha: float
    groups: tuple[str, ...]
    seed: int
    optimizer: torch.optim.AdamW
    steps: int = 0


class LoraTrainer:
    next_token_targets_only = False  # any per-position targets
    checkpoints_long_passes = True  # a pass too large to keep every activation recomputes its layers
    # An adapter on a tied unembedding adapts the output projection only: the merge gives lm_head
    # a weight of its own, which this process's model and the sampling engine both take.
    unties_unembedding = True

    def __init__(self, model_dir: str, *, cpu_gemm: str = "auto", dtype: str = "float32") -> None:
        if cpu_gemm not in CPU_GEMMS:
            raise ValueError(f"cpu_gemm {cpu_gemm!r}: allowed: {', '.join(CPU_GEMMS)}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r}: allowed: {', '.join(DTYPES)}")
        keep_freed_memory()
        # The frozen base model in ``dtype`` (bfloat16: half the memory and bf16 products); the
        # adapters and their AdamW state are fp32 whatever it is (``skyrl_core.lora.add_adapter``).
        self.dtype = dtype
        self.model = load_causal_lm(ModelConfig(path=model_dir, dtype=dtype))
        self.model.requires_grad_(False)
        # fp32 products on oneDNN (``skyrl_core.ops.onednn``, as the FSDP backend and the
        # skyrl-torch engine compute them): measured faster than MKL on this project's CPU.
        defaults = linear_defaults(cpu_gemm, self.model.dtype)
        self.ledger = prepare_model(self.model, "trainer", defaults=defaults)
        # The merged (bit-faithful) training path only when an op plugin (IsoExec) chose other
        # implementations than this runtime's own.
        self.merged_training = any(impl.name != defaults.get(op, DEFAULT_IMPLS[op]).name
                                   for (op, _), impl in self.ledger.declared.items())
        # Data that begin alike (an RL batch's samples of one prompt) are computed as one sequence,
        # the shared prefix once (``skyrl_core.ops.shared_prompts``), where the model's attention
        # keeps its meaning that way and no op plugin (IsoExec) promises bits of a row layout.
        sharing = model_allows_sharing(self.model) and prompt_sharing_allowed(self.ledger, ("trainer_forward", "trainer_score"))
        self.pair_cost = token_cost_in_pairs(self.model) if sharing and not self.merged_training else None
        self.config = self.model.config.get_text_config()
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.logprob_chunk_tokens = max(1, LOGPROB_CHUNK_BYTES // (4 * self.vocab_size))
        self.max_len = int(getattr(self.config, "max_position_embeddings", 4096))
        # fp32 bytes a position costs in a training pass: what each decoder layer keeps for backward
        # and the heap's slack around it, about 24 hidden-wide and 12 MLP-wide values (measured:
        # SmolLM2 with rank-8 LoRA on every projection, 3.7-4.3 MiB a position against 3.7 here;
        # norms, rotary, attention and LoRA's sums keep many hidden-wide copies). The logits do
        # not count: they are chunked (``_logprobs``).
        # A bf16 base keeps bf16 activations: half as many bytes (measured in docs/benchmarks.md).
        hidden = int(getattr(self.config, "hidden_size", 0))
        mlp = int(getattr(self.config, "intermediate_size", 0) or 4 * hidden)
        layers = int(getattr(self.config, "num_hidden_layers", 0))
        element = self.model.dtype.itemsize
        self.bytes_per_token = element * layers * (24 * hidden + 12 * mlp)
        self.layers, self.heads = layers, int(getattr(self.config, "num_attention_heads", 1))
        # With its layers checkpointed a pass keeps each layer's input and the residual stream, and
        # one layer's activations while backward recomputes it (SmolLM2: 0.27 MB a position, not 3.9)
        self.checkpointed_bytes_per_token = element * (2 * layers * hidden + 24 * hidden + 12 * mlp)
        memory = machine_memory_bytes()
        self.checkpoint_above_bytes = int(CHECKPOINT_ABOVE_MEMORY_SHARE * memory)
        self.max_train_tokens = self._longest_within(int(PASS_MEMORY_SHARE * memory), checkpointed=self.checkpoints_long_passes)
        self.adapter_memory_bytes = int(ADAPTER_MEMORY_SHARE * memory)
        self.adapters: dict[str, Adapter] = {}

    def pass_bytes(self, rows: int, length: int, *, checkpointed: bool = False) -> int:
        """Estimated memory of a training pass over ``rows`` data padded to ``length``. Attention
        (eager, fp32) adds per head and (query, key) pair: the scores and probabilities every layer
        keeps for backward, or with checkpointing one layer's, their gradients and the mask (a
        1024-token SmolLM2 datum: 4.2 GiB measured; 2048 checkpointed: 1.5)."""
        square = rows * length * length
        if checkpointed:
            return rows * length * self.checkpointed_bytes_per_token + 4 * (4 * self.heads + 2) * square
        return rows * length * self.bytes_per_token + 4 * 2 * self.layers * self.heads * square

    def _longest_within(self, limit: int, *, checkpointed: bool) -> int:
        """The longest datum a pass (checkpointed or not) holds within ``limit`` bytes."""
        low, high = 0, 1 << 24
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if self.pass_bytes(1, mid, checkpointed=checkpointed) <= limit else (low, mid - 1)
        return low

    # --- adapters ---------------------------------------------------------------------------------

    def check_groups(self, groups: tuple[str, ...]) -> list[str]:
        """The modules ``groups`` cover, or ``ValueError`` (before any adapter is made)."""
        return lora.target_modules(self.model, groups, unties_unembedding=self.unties_unembedding)

    def adapter_bytes(self, rank: int, groups: tuple[str, ...]) -> int:
        """Memory one adapter of ``rank`` on ``groups`` holds: A and B in fp32, their gradients and
        AdamW's two moments (SmolLM2, attention and MLP: 39 MB at rank 8, 1.25 GB at rank 256)."""
        modules = [self.model.get_submodule(name) for name in self.check_groups(groups)]
        return 16 * rank * sum(m.in_features + m.out_features for m in modules)

    def create(self, name: str, *, rank: int, alpha: float, groups: tuple[str, ...], seed: int) -> None:
        if name in self.adapters:
            raise ValueError(f"adapter {name!r} exists")
        modules = self.check_groups(groups)
        lora.add_adapter(self.model, name, rank=rank, alpha=alpha, modules=modules, seed=seed)
        params = lora.adapter_parameters(self.model, name)
        optimizer = torch.optim.AdamW(params, lr=0.0)
        self.adapters[name] = Adapter(name, rank, alpha, groups, seed, optimizer)

    def close(self) -> None:
        """(Adapters live in this process's memory: nothing else to free.)"""

    def remove(self, name: str) -> None:
        self.adapters.pop(name, None)
        for _, layer in lora.lora_layers(self.model):
            if name in layer.lora_A:
                layer.delete_adapter(name)

    def _adapter(self, name: str) -> Adapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            raise KeyError(f"model {name!r} has no adapter in this server process")
        return adapter

    def base_weights(self) -> dict[str, torch.Tensor]:
        """``<module>.weight`` -> base weight of every module any adapter wraps (the originals)."""
        return {f"{m}.weight": layer.get_base_layer().weight for m, layer in lora.lora_layers(self.model)}

    def hf_weights(self) -> dict[str, torch.Tensor]:
        """Every base weight by its Hugging Face name (adapters left out), a tied unembedding under
        both its names: a full set for an engine (one started untied gets its ``lm_head`` back)."""
        return {name.replace(".base_layer.", "."): p for name, p in self.model.named_parameters(remove_duplicate=False)
                if ".lora_" not in name}

    # --- computation ------------------------------------------------------------------------------

    @staticmethod
    def _pad(examples: Sequence[Example]) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Right-padded ``[B, T]`` token ids, mask and per-position inputs (zeros past each datum's
        end, and where a datum lacks an input), filled in numpy: a torch slice assignment per datum
        and input cost ~5 us each, 1-2 ms for an RL batch. (An ``Example`` holds one value per token
        of each input, so the concatenations line up with the mask's rows.)"""
        lengths = np.fromiter((len(e.tokens) for e in examples), dtype=np.int64, count=len(examples))
        real = np.arange(int(lengths.max())) < lengths[:, None]  # [B, T], row-major like the concatenations
        ids = np.zeros(real.shape, dtype=np.int64)
        ids[real] = np.concatenate([e.tokens for e in examples])
        inputs = {}
        for key in sorted(set().union(*(e.inputs for e in examples))):
            values = np.zeros(real.shape, dtype=np.int64 if key == "target_tokens" else np.float32)
            if all(key in e.inputs for e in examples):
                values[real] = np.concatenate([e.inputs[key] for e in examples])
            else:
                for row, e in enumerate(examples):
                    if key in e.inputs:
                        values[row, : lengths[row]] = e.inputs[key]
            inputs[key] = torch.from_numpy(values)
        return torch.from_numpy(ids), torch.from_numpy(real.astype(np.float32)), inputs

    def _groups(self, ids: torch.Tensor, mask: torch.Tensor) -> list[tuple[list[int], int]] | None:
        """The rows of a pass computed as one sequence each with their shared prefix
        (``prefix_groups``), or None where every row is computed alone."""
        if self.pair_cost is None or ids.shape[0] < 2:
            return None
        lengths = mask.sum(-1).long().tolist()
        groups = prefix_groups([ids[b, :n].tolist() for b, n in enumerate(lengths)], self.pair_cost)
        return groups if any(len(members) > 1 for members, _ in groups) else None

    def _logprobs(self, ids: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor,
                  groups: list[tuple[list[int], int]] | None = None) -> torch.Tensor:
        """``[B, T]`` logprob of ``targets[:, i]`` given ``ids[:, :i + 1]`` (right padding: 0 there);
        ``groups`` (``_groups``): each group's rows computed as one sequence, its prefix once.

        The output head and log-softmax run on the real positions only, ``logprob_chunk_tokens`` at
        a time (``skyrl_core.ops.chunked_logprobs``; under autograd each chunk is recomputed in
        backward), so a pass never holds ``[rows, length, vocabulary]`` logits or their gradient."""
        where = mask.bool()
        head = output_head(self.model)
        packed = None
        if groups is not None:
            lengths = mask.sum(-1).long().tolist()
            packed = pack_rows([ids[b, :n] for b, n in enumerate(lengths)], [m for m, _ in groups], [p for _, p in groups])
            rows, columns = where.nonzero(as_tuple=True)
            index = packed.index[rows, columns]

        def score(hidden: torch.Tensor) -> torch.Tensor:
            kept_targets = targets[where]
            inverse = None
            if packed is not None:
                # A group's shared prefix is one packed position for all its data, and but for its
                # last position, with one target too: each (position, target) pair is scored once
                # (an RL batch of 8 x 8 samples of 50-token prompts: half its output-head rows).
                width = int(kept_targets.max()) + 1
                pairs, inverse = torch.unique(index * width + kept_targets, return_inverse=True)
                kept = hidden.reshape(-1, hidden.shape[-1]).index_select(0, pairs // width)
                kept_targets = pairs % width
            else:
                kept = hidden[where]
            if kept.shape[0] <= self.logprob_chunk_tokens:  # one chunk: kept for backward, not recomputed
                logprobs = token_logprobs(head(kept), kept_targets, ledger=self.ledger)
            else:
                logprobs, _ = chunked_token_logprobs(kept, head, kept_targets, ledger=self.ledger,
                                                     chunk_tokens=self.logprob_chunk_tokens)
            if inverse is not None:
                logprobs = logprobs[inverse]
            return torch.zeros(where.shape, dtype=torch.float32).masked_scatter(where, logprobs.float())

        if packed is not None:
            return run_packed(self.model, packed, score)
        # (right padding: positions count from 0 in every row, and no real position sees a pad)
        return with_final_hidden(self.model, ids, mask.long(), ids.shape[1], score)

    @contextlib.contextmanager
    def _merged(self, tensors: dict[str, torch.Tensor] | None) -> Iterator[None]:
        """Compute with ``tensors`` (an adapter as ``lora.adapter_tensors`` gives it; None: the
        base model) merged into the base weights, every LoRA layer off. Each adapted linear's
        ``weight`` is replaced by its merged tensor for the duration (differentiable in A and B
        when the tensors are the live adapter), then the base parameter is put back untouched."""
        layers = dict(lora.lora_layers(self.model))
        swapped: list[tuple[torch.nn.Module, torch.nn.Parameter]] = []
        lora.select(self.model, None)
        try:
            if tensors:
                for value in tensors.values():  # a live adapter: select() left its tensors frozen
                    if isinstance(value, torch.nn.Parameter):
                        value.requires_grad_(True)
                for name, merged in lora.merged_weights(self.base_weights(), tensors):
                    module_name = name[: -len(".weight")]
                    # (a plain linear layer when the adapters live elsewhere: BackendLoraTrainer)
                    base_layer = layers[module_name].get_base_layer() if module_name in layers else self.model.get_submodule(module_name)
                    swapped.append((base_layer, base_layer._parameters.pop("weight")))
                    base_layer.weight = merged  # a plain tensor attribute, read by the layer's forward
            yield
        finally:
            for base_layer, weight in swapped:
                del base_layer.weight
                base_layer.register_parameter("weight", weight)

    def _micro_batches(self, examples: Sequence[Example]) -> Iterator[list[int]]:
        """Indices of ``examples`` in passes whose padded size fits ``MICRO_BATCH_BYTES`` (at least one
        datum each). The data go in order of length (a stable sort: the plan depends only on the
        lengths), so a pass pads its rows to a length close to theirs: an RL batch's responses vary
        (64 SmolLM2 data with 45-55 token prompts and 5-32 token responses: 8% fewer padded
        positions than in the order sent, ``docs/benchmarks.md``). Data sharing a prefix (``_groups``)
        go in a row, so that a pass computes their prefix once."""
        if self.pair_cost is not None:
            yield from self._shared_prefix_passes(examples)
            return
        order = sorted(range(len(examples)), key=lambda i: len(examples[i].tokens))
        part: list[int] = []
        for i in order:  # ascending: the datum joining a pass is its longest
            if part and self.pass_bytes(len(part) + 1, len(examples[i].tokens)) > MICRO_BATCH_BYTES:
                yield part
                part = []
            part.append(i)
        if part:
            yield part

    def _shared_prefix_passes(self, examples: Sequence[Example]) -> Iterator[list[int]]:
        """Passes of whole prefix groups (``prefix_groups``), sized by their packed form
        (``plan_group_passes``): a group is one sequence of its prefix and every datum's rest, so a
        pass of ``g`` groups holds ``g`` sequences of the longest one's length. A group too large for
        a pass is cut into parts, each computed as one sequence with the same prefix."""
        tokens = [e.tokens.tolist() for e in examples]
        groups = prefix_groups(tokens, self.pair_cost)
        rests = [0] * len(tokens)
        for members, prefix in groups:
            for i in members:
                rests[i] = len(tokens[i]) - prefix
        yield from plan_group_passes(
            groups, rests,
            part_fits=lambda count, length: self.pass_bytes(1, length) <= MICRO_BATCH_BYTES,
            pass_fits=lambda parts: self.pass_bytes(len(parts), max(n for _, n in parts)) <= MICRO_BATCH_BYTES,
        )

    def _run(
        self, examples: Sequence[Example], loss_fn: str, loss_config: dict[str, Any] | None, *, backward: bool
    ) -> tuple[list[np.ndarray], dict[str, float]]:
        outputs: list[np.ndarray] = [np.zeros(0, dtype=np.float32)] * len(examples)
        total = 0.0
        summed: dict[str, float] = {}
        largest = 0
        for indices in self._micro_batches(examples):
            part = [examples[i] for i in indices]
            ids, mask, inputs = self._pad(part)
            groups = self._groups(ids, mask)
            estimate = self.pass_bytes(*ids.shape)
            if groups is not None:  # one sequence per group: fewer positions, a larger attention square
                lengths = mask.sum(-1).long().tolist()
                packed_length = max(p + sum(lengths[m] - p for m in members) for members, p in groups)
                estimate = max(estimate, self.pass_bytes(len(groups), packed_length))
            largest = max(largest, estimate)
            # (one datum: _micro_batches puts no second datum in a pass this large)
            long_pass = estimate > self.checkpoint_above_bytes
            with contextlib.ExitStack() as scope:
                scope.enter_context(torch.set_grad_enabled(backward))
                scope.enter_context(site_scope("trainer_forward" if backward else "trainer_score"))
                if long_pass:
                    scope.enter_context(own_maps_above(LONG_PASS_MMAP_MIB))
                    if backward:
                        scope.enter_context(checkpointed_layers(decoder_layers(self.model)))
                logprobs = self._logprobs(ids, mask, inputs["target_tokens"], groups)
                loss, metrics = compute_loss(loss_fn, loss_config, logprobs, inputs, mask)
                if backward:
                    loss.backward()
            rows = logprobs.detach().float().numpy()
            for row, (i, e) in enumerate(zip(indices, part)):
                outputs[i] = rows[row, : len(e.tokens)].copy()
            total += float(loss.detach())
            for key, value in metrics.items():  # per-micro-batch means, weighted by rows
                summed[key] = summed.get(key, 0.0) + float(value) * len(part)
        metrics_out = {f"{k}:mean": v / len(examples) for k, v in summed.items()}
        metrics_out["loss:sum"] = total
        if largest >= RELEASE_AFTER_BYTES:
            release_freed_memory()  # (a small pass leaves little to give back; trimming costs ~10 ms)
        return outputs, metrics_out

    def forward(
        self, name: str, examples: Sequence[Example], loss_fn: str, loss_config: dict[str, Any] | None
    ) -> tuple[list[np.ndarray], dict[str, float]]:
        """Logprobs and loss with the adapter merged (the sampler's weights); no gradient."""
        self._adapter(name)
        with self._merged(lora.adapter_tensors(self.model, name)):
            return self._run(examples, loss_fn, loss_config, backward=False)

    def forward_backward(
        self, name: str, examples: Sequence[Example], loss_fn: str, loss_config: dict[str, Any] | None
    ) -> tuple[list[np.ndarray], dict[str, float]]:
        """Logprobs and loss; gradients accumulate in adapter ``name``. Through peft's LoRA layers
        (``W x + s B A x``, cheap) with stock ops; when an op plugin installs its own ops
        (IsoExec), through the merged weights, differentiable in A and B, so that these logprobs
        are the sampler's bits too (one weight-sized gradient product more per adapted layer).
        A call that fails (in any pass, in the loss or inside backward) leaves the adapter's
        gradients as it found them."""
        self._adapter(name)
        with gradients_restored_on_failure(lora.adapter_parameters(self.model, name)):
            if self.merged_training:
                with self._merged(lora.adapter_tensors(self.model, name, live=True)):
                    return self._run(examples, loss_fn, loss_config, backward=True)
            lora.select(self.model, name)
            try:
                with lora.fused_forward(self.model, name):
                    return self._run(examples, loss_fn, loss_config, backward=True)
            finally:
                lora.select(self.model, None)

    def score(self, tensors: dict[str, torch.Tensor] | None, tokens: Sequence[int]) -> np.ndarray:
        """Prompt logprobs ``[len - 1]`` of ``tokens[1:]`` under ``tensors`` merged (None: base)."""
        if len(tokens) < 2:
            return np.zeros(0, dtype=np.float32)
        example = Example(np.asarray(tokens[:-1], dtype=np.int64), {"target_tokens": np.asarray(tokens[1:], dtype=np.int64)})
        with self._merged(tensors), torch.no_grad(), site_scope("trainer_score"):
            ids, mask, inputs = self._pad([example])
            return self._logprobs(ids, mask, inputs["target_tokens"])[0].float().numpy().copy()

    def optim_step(self, name: str, step: AdamStep) -> dict[str, float]:
        adapter = self._adapter(name)
        params = lora.adapter_parameters(self.model, name)
        for group in adapter.optimizer.param_groups:
            group.update(lr=step.learning_rate, betas=(step.beta1, step.beta2), eps=step.eps, weight_decay=step.weight_decay)
        grads = [p.grad for p in params if p.grad is not None]
        grad_norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) if grads else 0.0
        if step.grad_clip_norm > 0 and grads:
            torch.nn.utils.clip_grad_norm_(params, step.grad_clip_norm)
        if math.isfinite(grad_norm):  # a non-finite gradient skips the update
            adapter.optimizer.step()
        adapter.optimizer.zero_grad(set_to_none=True)
        adapter.steps += 1
        return {"grad_norm:mean": grad_norm, "learning_rate:mean": step.learning_rate}

    # --- state ------------------------------------------------------------------------------------

    def adapter_tensors(self, name: str) -> dict[str, torch.Tensor]:
        self._adapter(name)
        return lora.adapter_tensors(self.model, name)

    def meta(self, name: str) -> dict[str, Any]:
        a = self._adapter(name)
        return {"rank": a.rank, "alpha": a.alpha, "groups": list(a.groups), "seed": a.seed, "steps": a.steps}

    def save(self, name: str, directory: str, *, optimizer: bool) -> dict[str, torch.Tensor]:
        """Adapter tensors (safetensors), its description, and (``optimizer``) its AdamW state;
        returns the adapter tensors written (copies: what ``read_adapter`` would read back)."""
        from safetensors.torch import save_file

        os.makedirs(directory, exist_ok=True)
        tensors = self.adapter_tensors(name)
        save_file(tensors, os.path.join(directory, ADAPTER_FILE))
        if optimizer:
            torch.save(self._adapter(name).optimizer.state_dict(), os.path.join(directory, OPTIMIZER_FILE))
        with open(os.path.join(directory, META_FILE), "w") as f:
            json.dump(self.meta(name), f)
        return tensors

    def load(self, name: str, directory: str, *, optimizer: bool) -> None:
        """Load what ``save`` wrote into adapter ``name`` (which has the checkpoint's rank and
        targets); without ``optimizer`` the AdamW state starts fresh."""
        tensors = read_adapter(directory)
        adapter = self._adapter(name)
        lora.load_adapter_tensors(self.model, name, tensors)
        adapter.optimizer.zero_grad(set_to_none=True)
        if optimizer:
            path = os.path.join(directory, OPTIMIZER_FILE)
            if not os.path.exists(path):
                raise ValueError(f"{directory} holds no optimizer state (saved for sampling only)")
            adapter.optimizer.load_state_dict(torch.load(path, weights_only=True))
        else:
            adapter.optimizer.state.clear()
        adapter.steps = int(read_meta(directory).get("steps", 0)) if optimizer else 0


def read_adapter(directory: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(directory, ADAPTER_FILE))


def read_meta(directory: str) -> dict[str, Any]:
    with open(os.path.join(directory, META_FILE)) as f:
        return json.load(f)
