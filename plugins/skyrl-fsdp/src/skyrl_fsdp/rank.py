"""One data-parallel rank: an FSDP2-sharded policy, its AdamW optimizer and LR schedule.

``FSDPBackend`` drives one rank in-process (world size 1) or N of them as Ray actors. Every rank
receives its own rows of a batch and the number of micro-batches that *every* rank runs: FSDP's
collectives (all-gather in forward, reduce-scatter in backward) must be entered the same number of
times on each rank, so a rank with fewer rows runs "filler" passes whose gradient is exactly zero.
"""

from __future__ import annotations

import math
import os
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from skyrl_core.backends.activation_checkpointing import checkpoint_layers, decoder_layers
from skyrl_core.backends.packing import scatter_rows, trim
from skyrl_core.backends.gradients_on_failure import gradients_restored_on_failure
from skyrl_core.backends.rank_setup import (
    accepts_keyword,
    batch_to_device,
    join_process_group,
    resolve_device,
    use_memory_efficient_attention,
)
from skyrl_core.config.schema import ModelConfig, TrainerConfig
from skyrl_core.heap import keep_freed_memory
from skyrl_core.interfaces import LossFn
from skyrl_core.models import load_causal_lm, load_tokenizer, tied_aliases
from skyrl_core.ops.gemm_choice import linear_defaults
from skyrl_core.rng_state import capture_rng_state, restore_rng_state
from skyrl_core.state_file import load_state, save_state
from skyrl_core.ops import prepare_model, site_scope
from skyrl_core.ops.chunked_logprobs import response_logprobs
from skyrl_core.ops.shared_prompts import (
    groups_to_share,
    model_allows_sharing,
    prompt_sharing_allowed,
    shared_prompt_logprobs,
    token_cost_in_pairs,
)
from skyrl_core.types import OptimizerHyperparams, TrainingBatch
from skyrl_fsdp.gathered import gathered_for_call
from skyrl_fsdp.hf_io import read_hf_weights, write_hf_dir
from skyrl_fsdp.lora import apply_lora, hf_state_dict, is_adapter_tensor, read_adapter, save_adapter
from skyrl_fsdp.options import FSDPOptions
from skyrl_core.lr_schedule import scheduled_lr

OPTIMIZER_FILE = "optimizer.safetensors"
TRAINER_STATE_FILE = "fsdp_trainer_state.safetensors"
# 2: optimizer and trainer state in safetensors + JSON (format 1 used torch.save, i.e. pickle).
CHECKPOINT_FORMAT = 2

# The in-process rank shares one default process group per process between backends.
_process_group_users = 0
_process_group_owned = False


def _acquire_process_group(device: torch.device, rank: int, world_size: int, init_method: str | None) -> None:
    global _process_group_users, _process_group_owned
    # Where CUDA exists, one group serves both devices: in-process backends of either kind share it.
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    if join_process_group(backend, rank, world_size, init_method, who="FSDP"):
        _process_group_owned = True
    _process_group_users += 1


def _release_process_group() -> None:
    global _process_group_users, _process_group_owned
    _process_group_users -= 1
    if _process_group_users == 0 and _process_group_owned and dist.is_initialized():
        dist.destroy_process_group()
        _process_group_owned = False


def _positions_to_score(micro: TrainingBatch) -> torch.Tensor:
    """Where a training pass computes logprobs: the loss mask's tokens. A micro-batch without any
    still scores its real tokens (all with zero weight): its backward must run through every layer,
    since the other ranks' backward collectives wait for this rank's."""
    real = micro.attention_mask[:, -micro.response_len:].bool()
    trained = micro.loss_mask.bool() & real
    if bool(trained.any()):
        return trained
    return real if bool(real.any()) else torch.ones_like(real)


def _scalar(value: Any) -> float:
    return float(value.detach()) if isinstance(value, torch.Tensor) else float(value)


class FSDPRank:
    """The policy shard and optimizer of rank ``rank`` of ``world_size``.

    Master weights are always fp32; with ``mixed_precision="bf16"`` (what ``model.dtype: bfloat16``
    resolves to, ``skyrl_fsdp.precision``) FSDP gathers them as bf16 for compute and reduces
    gradients in fp32.
    The model stays in eval mode: dropout off, so scoring and training see the same function.
    """

    def __init__(
        self,
        model: ModelConfig,
        options: FSDPOptions,
        trainer: TrainerConfig,
        *,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        init_method: str | None = None,
    ) -> None:
        keep_freed_memory()  # per process: Ray ranks are fresh interpreters
        if options.threads_per_rank is not None:
            torch.set_num_threads(options.threads_per_rank)
        self.model_config = model
        self.options = options
        self.trainer = trainer
        self.rank = rank
        self.world_size = world_size
        self.device = resolve_device(options.device)
        _acquire_process_group(self.device, rank, world_size, init_method)
        self._closed = False

        # Same seed on every rank: identical initial weights before sharding.
        self.model = load_causal_lm(attrs.evolve(model, dtype="float32"), seed=seed)
        use_memory_efficient_attention(self.model)  # memory linear, not quadratic, in sequence length
        compute_dtype = torch.bfloat16 if options.mixed_precision == "bf16" else None
        defaults = linear_defaults(options.cpu_gemm, compute_dtype or torch.float32, self.device.type)
        self.ledger = prepare_model(self.model, "trainer", compute_dtype=compute_dtype, defaults=defaults)
        self.aliases = tied_aliases(self.model)
        self.shares_prompts = (options.share_prompts and model_allows_sharing(self.model)
                               and prompt_sharing_allowed(self.ledger, ("trainer_score", "trainer_forward")))
        self.pair_cost = token_cost_in_pairs(self.model) if self.shares_prompts else 0.0
        if options.lora is not None:  # after the op sites: the adapter's own small products stay stock
            apply_lora(self.model, options.lora, seed)
        if trainer.activation_checkpointing:
            checkpoint_layers(decoder_layers(self.model))
        self.model.to(self.device)
        self._shard()

        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.model.parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": trainer.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=trainer.lr,
            fused=True,  # one kernel per tensor: 3x the default on CPU (same update, other rounding order)
        )
        self.optimizer_steps = 0
        # One optimizer step per mini-batch per PPO epoch of every training step.
        self.total_optimizer_steps = trainer.steps * trainer.mini_batches * trainer.ppo_epochs

    def _shard(self) -> None:
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        if self.options.mixed_precision == "bf16":
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        else:
            policy = MixedPrecisionPolicy()
        layers = getattr(getattr(self.model, "model", None), "layers", None)
        for layer in layers or ():
            fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=self.options.reshard_after_forward)
        # The root holds embeddings, final norm and lm_head (tied embeddings stay in one group).
        fully_shard(self.model, mesh=mesh, mp_policy=policy, reshard_after_forward=self.options.reshard_after_forward)
        for module in self.model.modules():
            if isinstance(module, FSDPModule) and self.world_size > 1:
                # Sum gradients over ranks instead of averaging: each rank's loss is already its
                # share of the whole batch's loss (normalised by the caller's token weights). (One
                # rank is left as it is: its average is the sum, and with a factor set FSDP divides
                # every gradient by 1.0 after each micro-batch, ~8% of a bf16 step's profile.)
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum

    # --- computation -------------------------------------------------------------------------

    def _micro_batches(
        self, part: TrainingBatch, plan: list[list[int]], num_micro: int, filler: TrainingBatch | None
    ) -> list[tuple[TrainingBatch, bool]]:
        """This rank's micro-batches (``plan``: row indices of each, from the driver), trimmed, then
        filler passes up to ``num_micro``."""
        if len(plan) > num_micro:
            raise AssertionError(f"rank {self.rank} got {len(plan)} micro-batches, more than {num_micro}")
        if len(plan) < num_micro and filler is None:
            raise AssertionError(f"rank {self.rank} needs filler passes but got no filler row")
        passes = [(part.select(rows), True) for rows in plan] + [(filler, False)] * (num_micro - len(plan))
        return [(batch_to_device(trim(mb), self.device), is_real) for mb, is_real in passes]

    def _response_logprobs(
        self, batch: TrainingBatch, temperature: float, with_entropy: bool, where: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logprobs ``[B, R]`` of the response tokens where ``where`` is true (0 elsewhere), and their
        entropy if asked; logits exist ``trainer.logprob_chunk_tokens`` positions at a time. Rows that
        share a prompt compute it once (``options.share_prompts``)."""
        groups = (groups_to_share(batch.input_ids, batch.attention_mask, batch.prompt_len, where, self.pair_cost)
                  if self.shares_prompts and batch.position_ids is None else None)
        if groups is not None:
            return shared_prompt_logprobs(
                self.model, batch.input_ids, batch.attention_mask, batch.response_len, where, ledger=self.ledger,
                temperature=temperature, chunk_tokens=self.trainer.logprob_chunk_tokens, with_entropy=with_entropy,
                groups=groups,
            )
        return response_logprobs(
            self.model, batch.input_ids, batch.attention_mask, batch.response_len, where, ledger=self.ledger,
            temperature=temperature, chunk_tokens=self.trainer.logprob_chunk_tokens, with_entropy=with_entropy,
            position_ids=batch.position_ids,
        )

    def prompt_pair_cost(self) -> float:
        """0.0 when this rank computes rows apart; else the model's ``token_cost_in_pairs``, with which
        the driver plans micro-batches of whole prompt groups."""
        return self.pair_cost

    def forward(
        self, part: TrainingBatch, temperature: float, plan: list[list[int]], num_micro: int, filler: TrainingBatch | None
    ) -> torch.Tensor:
        outputs = []
        with torch.no_grad(), site_scope("trainer_score"), self._gathered_for_call():
            for (micro, real), rows in zip(self._micro_batches(part, plan, num_micro, filler), plan + [None] * num_micro):
                real_tokens = micro.attention_mask[:, -micro.response_len:].bool()
                logprobs, _ = self._response_logprobs(micro, temperature, False, real_tokens)
                if real:
                    outputs.append((rows, logprobs.float().cpu()))
        return scatter_rows(outputs, len(part), part.response_len)

    def forward_backward(
        self, part: TrainingBatch, loss_fn: LossFn, plan: list[list[int]], num_micro: int, filler: TrainingBatch | None,
        temperature: float,
    ) -> list[tuple[dict[str, float], float]]:
        """Per real micro-batch: ``({**metrics, "loss": loss}, trained tokens)``. Gradients accumulate
        in the shards; a call whose loss raises leaves them as it found them (one that fails inside
        backward is not undone: FSDP's per-parameter state is left mid-step). Logprobs are computed only
        where the loss mask is set (the loss reads no other)."""
        wants_entropy = accepts_keyword(loss_fn, "entropy")
        results = []
        passes = self._micro_batches(part, plan, num_micro, filler)
        # A call whose loss fails part-way adds nothing: its finished micro-batches' gradients are
        # already in the shards.
        with gradients_restored_on_failure(self.model.parameters()):
            with self._gathered_for_call() as before_last_backward:
                for index, (micro, real) in enumerate(passes):
                    if index == len(passes) - 1:
                        before_last_backward()
                    results.extend(self._forward_backward_one(micro, real, loss_fn, temperature, wants_entropy))
        return results

    def _gathered_for_call(self):
        return gathered_for_call(
            self.model, enabled=self.options.keep_gathered_params, reshard_after_forward=self.options.reshard_after_forward
        )

    def _forward_backward_one(
        self, micro: TrainingBatch, real: bool, loss_fn: LossFn, temperature: float, wants_entropy: bool
    ) -> list[tuple[dict[str, float], float]]:
        """One micro-batch's forward and backward: ``[(metrics, trained tokens)]`` if real, else ``[]``."""
        trained = _positions_to_score(micro)
        with site_scope("trainer_forward"):
            if real:
                logprobs, entropy = self._response_logprobs(micro, temperature, wants_entropy, trained)
                extra = {"entropy": entropy} if wants_entropy else {}
                loss, metrics = loss_fn(logprobs, micro, **extra)
            else:  # joins the collectives, contributes exactly zero gradient
                logprobs, _ = self._response_logprobs(micro, temperature, False, torch.ones_like(trained))
                loss, metrics = logprobs.sum() * 0.0, {}
            loss.backward()
        if not real:
            return []
        record = {**{k: _scalar(v) for k, v in metrics.items()}, "loss": _scalar(loss)}
        return [(record, float(trained.sum()))]

    def optim_step(self, hyperparams: OptimizerHyperparams | None = None) -> dict[str, float]:
        if hyperparams is None:
            lr = scheduled_lr(self.trainer, self.optimizer_steps, self.total_optimizer_steps)
            clip = self.trainer.grad_clip
        else:  # the caller's settings for this step (the no-decay group keeps weight decay 0)
            lr, clip = hyperparams.lr, hyperparams.grad_clip or math.inf
            for group in self.optimizer.param_groups:
                group["betas"], group["eps"] = tuple(hyperparams.betas), hyperparams.eps
            self.optimizer.param_groups[0]["weight_decay"] = hyperparams.weight_decay
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        grad_norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        if math.isfinite(grad_norm):  # a non-finite gradient skips the update
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        return {"grad_norm": grad_norm, "lr": lr}

    # --- state ---------------------------------------------------------------------------------

    def full_state_dict(self, *, lora_names: bool = False) -> dict[str, torch.Tensor]:
        """Unsharded fp32 weights by Hugging Face name on rank 0 (CPU); ``{}`` on other ranks. With
        LoRA, the adapter merged into the base weights (``lora_names``: peft's names, unmerged).
        Collective: every rank must call it."""
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.options.lora is None or lora_names or not state:
            return state
        return hf_state_dict(state, self.options.lora)

    def _tokenizer(self) -> Any:
        return load_tokenizer(self.model_config)  # a config-built model's byte tokenizer writes its marker

    def save_hf(self, path: str) -> None:
        """Rank 0 writes a Hugging Face directory into the existing ``path``. Collective."""
        weights = self.full_state_dict()
        if self.rank == 0:
            write_hf_dir(path, weights, self.model.config, self.aliases, self._tokenizer())
        dist.barrier()

    def save_checkpoint(self, path: str) -> None:
        """Rank 0 writes weights (a Hugging Face directory), optimizer and trainer state (step,
        every rank's RNG) into the existing ``path``. Collective."""
        weights = self.full_state_dict(lora_names=True)
        if self.optimizer.state:
            optim = get_optimizer_state_dict(
                self.model, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
        else:  # asking for the state of a fresh optimizer would initialise it with a dummy step
            optim = {}
        rng_states: list[Any] = [None] * self.world_size
        dist.all_gather_object(rng_states, capture_rng_state())
        if self.rank == 0:
            if self.options.lora is not None:  # the merged model for readers, the adapter for resuming
                save_adapter(path, weights)
                weights = hf_state_dict(weights, self.options.lora)
            write_hf_dir(path, weights, self.model.config, self.aliases, self._tokenizer())
            save_state(os.path.join(path, OPTIMIZER_FILE), optim)
            state = {
                "format": CHECKPOINT_FORMAT,
                "optimizer_steps": self.optimizer_steps,
                "world_size": self.world_size,
                "rng": rng_states,
            }
            save_state(os.path.join(path, TRAINER_STATE_FILE), state)
        dist.barrier()

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter's own tensors (peft names) on rank 0; ``{}`` elsewhere. Collective."""
        return {k: v for k, v in self.full_state_dict(lora_names=True).items() if is_adapter_tensor(k)}

    def load_checkpoint(self, path: str, optimizer: bool = True) -> None:
        """Restore what ``save_checkpoint`` wrote (any world size; RNG per rank when it matches);
        without ``optimizer`` the weights only (the optimizer starts fresh)."""
        state = load_state(os.path.join(path, TRAINER_STATE_FILE))
        if state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{path}: checkpoint format {state.get('format')!r}, this backend reads {CHECKPOINT_FORMAT}")
        full = StateDictOptions(full_state_dict=True)
        if self.options.lora is not None:  # the base weights are frozen: only the adapter moved
            set_model_state_dict(self.model, read_adapter(path), options=StateDictOptions(full_state_dict=True, strict=False))
        else:
            set_model_state_dict(self.model, read_hf_weights(path, self.aliases), options=full)
        optim = load_state(os.path.join(path, OPTIMIZER_FILE)) if optimizer else {}
        if optim:
            set_optimizer_state_dict(self.model, self.optimizer, optim, options=full)
        else:
            self.optimizer.state.clear()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps = int(state["optimizer_steps"])
        if self.rank < len(state["rng"]):
            restore_rng_state(state["rng"][self.rank])

    def execution_contract(self) -> dict[str, Any]:
        return {
            "ledger": self.ledger.as_dict(),
            "backend": "fsdp",
            "world_size": self.world_size,
            "mixed_precision": self.options.mixed_precision,
            "device": self.device.type,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        }

    def ready(self) -> int:
        return self.rank

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        del self.optimizer, self.model
        _release_process_group()
