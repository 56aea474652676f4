"""One process of the Megatron backend: a tensor-parallel shard of a ``GPTModel``, its optimizer
and LR schedule.

``MegatronBackend`` drives one rank in-process (world size 1) or N of them as Ray actors. Global
rank ``r`` is tensor-parallel rank ``r % tp`` of data-parallel replica ``r // tp`` (megatron-core's
default order). Every rank of a replica receives the same rows; each replica its own rows.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import attrs
import torch
import torch.distributed as dist

from skyrl_core.backends.gradients_on_failure import gradients_restored_on_failure
from skyrl_core.backends.packing import plan_micro_batches, scatter_rows
from skyrl_core.backends.rank_setup import accepts_keyword, batch_to_device, join_process_group, resolve_device
from skyrl_core.config.schema import ModelConfig, TrainerConfig
from skyrl_core.interfaces import LossFn
from skyrl_core.models import load_causal_lm
from skyrl_core.ops import prepare_model, site_scope, token_logprobs
from skyrl_core.ops.install import DEFAULT_IMPLS
from skyrl_core.rng_state import capture_rng_state, restore_rng_state
from skyrl_core.types import OptimizerHyperparams, TrainingBatch
from skyrl_megatron import logprobs as vp
from skyrl_megatron import lora
from skyrl_megatron.collectives import all_gather
from skyrl_megatron.convert import expert_name, hf_to_megatron, megatron_to_hf
from skyrl_megatron.layer_spec import choose_layer_spec, installed_trainer_ops, log_choice
from skyrl_megatron.layout import GPTLayout, check_parallel, layout_from_hf_config
from skyrl_megatron.model import build_gpt_model, left_align, load_parameters, transformer_engine_available
from skyrl_megatron.ops_sites import patch_megatron_model
from skyrl_megatron.optimizers import MegatronAdam, ShardedAdamW, wrap_for_gpu_training
from skyrl_megatron.options import MegatronOptions
from skyrl_core.heap import keep_freed_memory
from skyrl_core.local_ray import adopt_skyrl_environment
from skyrl_core.lr_schedule import scheduled_lr
from skyrl_core.state_file import load_state, save_state

# 2: state in safetensors + JSON (format 1 used torch.save, i.e. pickle, which loading would execute).
CHECKPOINT_FORMAT = 2
TRAINER_STATE_FILE = "megatron_trainer_state.safetensors"


def shard_file(rank: int) -> str:
    return f"megatron_rank{rank:03d}.safetensors"


# megatron-core's parallel state (process groups, RNG tracker, memory buffer) is global to a
# process. In-process ranks all have world size 1, so they share one, counted here.
_parallel_users = 0
_owns_process_group = False


def _acquire_parallel_state(
    device: torch.device, rank: int, world_size: int, tp: int, ep: int, init_method: str | None, seed: int
) -> None:
    global _parallel_users, _owns_process_group
    if device.type == "cpu":
        from skyrl_megatron.quiet_imports import silence_cpu_fallback_notes

        silence_cpu_fallback_notes()
    from megatron.core import parallel_state

    if _parallel_users:
        if parallel_state.get_tensor_model_parallel_world_size() != tp or dist.get_world_size() != world_size:
            raise RuntimeError(
                f"this process already runs a Megatron backend with tensor_parallel="
                f"{parallel_state.get_tensor_model_parallel_world_size()} of {dist.get_world_size()} processes; "
                f"a second one needs tensor_parallel={tp} of {world_size} (use launcher='ray')"
            )
        _parallel_users += 1
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if join_process_group(backend, rank, world_size, init_method, who="Megatron"):
        _owns_process_group = True
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    if device.type == "cpu":
        from skyrl_megatron import cpu_compat

        cpu_compat.apply(seed)
    else:  # pragma: no cover - needs CUDA
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
    _parallel_users = 1


def _release_parallel_state() -> None:
    global _parallel_users, _owns_process_group
    from megatron.core import parallel_state

    _parallel_users -= 1
    if _parallel_users:
        return
    parallel_state.destroy_model_parallel()
    if _owns_process_group and dist.is_initialized():
        dist.destroy_process_group()
    _owns_process_group = False


class MegatronRank:
    """Rank ``rank`` of ``options.processes``. Parameters are fp32, or bf16 with
    ``mixed_precision='bf16'`` (GPU only: megatron's optimizer then keeps fp32 main parameters).
    Dropout is off."""

    def __init__(
        self,
        model: ModelConfig,
        options: MegatronOptions,
        trainer: TrainerConfig,
        *,
        seed: int,
        rank: int = 0,
        init_method: str | None = None,
        environ: dict[str, str] | None = None,
    ) -> None:
        if environ is not None:
            adopt_skyrl_environment(environ)
        keep_freed_memory()  # per process: Ray ranks are fresh interpreters (skyrl_core.heap)
        if options.torch_threads is not None:
            torch.set_num_threads(options.torch_threads)
        self.options, self.trainer, self.model_config = options, trainer, model
        self.rank, self.world_size, self.tp = rank, options.processes, options.tensor_parallel
        self.device = resolve_device(options.device)
        if options.mixed_precision == "bf16" and self.device.type == "cpu":
            raise ValueError(
                "backend.options.mixed_precision='bf16' needs device 'cuda' (megatron's mixed-precision optimizer); "
                "on CPU the megatron backend trains in fp32"
            )
        self.params_dtype = torch.bfloat16 if options.mixed_precision == "bf16" else torch.float32
        self.ep = options.expert_parallel
        _acquire_parallel_state(self.device, rank, self.world_size, self.tp, self.ep, init_method, seed)
        self._closed = False
        self._init_groups()
        try:
            self._build(model, seed)
        except BaseException:
            self.close()
            raise

    # --- construction ------------------------------------------------------------------------

    def _init_groups(self) -> None:
        from megatron.core import parallel_state

        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        if (self.tp_rank, self.dp_rank) != (self.rank % self.tp, self.rank // self.tp):
            raise AssertionError(f"megatron placed rank {self.rank} at tp {self.tp_rank}, dp {self.dp_rank}")
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.ep_rank = parallel_state.get_expert_model_parallel_rank()
        self.ep_group = parallel_state.get_expert_model_parallel_group()
        self.expert_dp_group = parallel_state.get_expert_data_parallel_group()
        self.expert_shard_group = parallel_state.get_expert_tensor_and_model_parallel_group()

    def _build(self, model: ModelConfig, seed: int) -> None:
        # Same seed on every rank: identical full weights, of which each rank keeps its shard.
        hf_model = load_causal_lm(attrs.evolve(model, dtype="float32"), seed=seed)
        self.hf_config = hf_model.config
        self.layout: GPTLayout = layout_from_hf_config(hf_model.config)
        check_parallel(self.layout, tensor_parallel=self.tp, expert_parallel=self.ep)
        if self.options.lora is not None:
            lora.check(self.options.lora, self.layout)
            if self.device.type != "cpu":  # pragma: no cover - needs CUDA
                raise ValueError("backend.options.lora: LoRA in the megatron backend is built for CPU ranks (device: cpu); "
                                 "megatron's GPU optimizer path is not built for frozen base weights. Use the fsdp backend on GPU")
        hf_state = hf_model.state_dict()
        # Transformer Engine's layers on CUDA, unless an op plugin (IsoExec) needs the local layers.
        choice = choose_layer_spec(
            device_type=self.device.type,
            te_available=self.device.type == "cuda" and transformer_engine_available(),
            model_type=self.layout.model_type,
            installed_ops=installed_trainer_ops(),
        )
        log_choice(choice, rank=self.rank, dtype=str(self.params_dtype).removeprefix("torch."))
        self.layer_spec_reason = choice.reason
        self.use_transformer_engine = choice.transformer_engine
        self.model = build_gpt_model(
            self.layout,
            tensor_parallel=self.tp,
            params_dtype=self.params_dtype,
            use_transformer_engine=self.use_transformer_engine,
            on_cpu=self.device.type == "cpu",
        )
        shard = hf_to_megatron(
            hf_state,
            self.layout,
            tp_rank=self.tp_rank,
            tp_size=self.tp,
            ep_rank=self.ep_rank,
            ep_size=self.ep,
            fused_norms=self.use_transformer_engine,
        )
        load_parameters(self.model, shard)
        del hf_state, shard
        self.vocab_width = self.layout.padded_vocab_size(self.tp) // self.tp
        if self.options.lora is not None:  # frozen base, adapters on its linears (skyrl_megatron.lora)
            lora.attach(self.model, hf_model, self.options.lora, self.layout, seed=seed, tp=self.tp, tp_rank=self.tp_rank)
        del hf_model
        # Op sites: megatron's layers dispatch to what plugins install (skyrl_megatron.ops_sites).
        self.ledger = prepare_model(
            self.model, "trainer", patcher=functools.partial(patch_megatron_model, vocab_size=self.layout.vocab_size)
        )
        self.optimizer_steps = 0
        # One optimizer step per mini-batch per PPO epoch of every training step.
        self.total_optimizer_steps = self.trainer.steps * self.trainer.mini_batches * self.trainer.ppo_epochs
        if self.device.type == "cpu":
            self.module = self.model
            self.optimizer: Any = ShardedAdamW(
                self.model,
                weight_decay=self.trainer.weight_decay,
                grad_clip=self.trainer.grad_clip,
                tp_group=self.tp_group,
                dp_group=self.dp_group,
                expert_dp_group=self.expert_dp_group,
                expert_shard_group=self.expert_shard_group,
            )
        else:  # pragma: no cover - needs CUDA
            self.model.to(self.device)
            self.module = wrap_for_gpu_training(self.model)
            self.optimizer = MegatronAdam(
                self.module,
                lr=self.trainer.lr,
                weight_decay=self.trainer.weight_decay,
                grad_clip=self.trainer.grad_clip,
                bf16=self.params_dtype == torch.bfloat16,
            )

    # --- computation -------------------------------------------------------------------------

    def _vocab_logits(self, batch: TrainingBatch, rows: int | None = None) -> torch.Tensor:
        """This rank's vocabulary slice of the raw logits predicting each response token: ``[B, R, V/tp]``.

        ``rows``: run the model on that many rows, padding with empty ones (expert parallelism
        gathers tokens across ranks in equal shares, so every rank's pass must have the same shape).
        """
        ids, mask = batch.input_ids, batch.attention_mask
        if rows is not None and rows > len(batch):
            empty = rows - len(batch)
            ids = torch.cat([ids, ids.new_zeros(empty, ids.shape[1])])
            mask = torch.cat([mask, mask.new_zeros(empty, mask.shape[1])])
        P, R = batch.prompt_len, batch.response_len
        aligned, shift = left_align(ids, mask)
        first = P - shift - 1  # aligned position whose logits predict response token 0
        if bool(((first < 0) & mask[:, P].bool()).any()):
            raise ValueError("a row has a response but no prompt token: its first response token has no context")
        if self.model.config.sequence_parallel and aligned.shape[1] % self.tp:
            # Sequence parallelism splits the sequence over the tensor-parallel ranks: pad it to a
            # multiple of them. Trailing padding is out of every real token's causal view.
            aligned = torch.nn.functional.pad(aligned, (0, -aligned.shape[1] % self.tp))
        B, S = aligned.shape
        positions = torch.arange(S, device=ids.device).expand(B, S)
        # Local attention needs the causal mask spelled out (its default one is built on CUDA);
        # Transformer Engine builds it from the layer's causal mask type.
        causal = None if self.use_transformer_engine else torch.ones(S, S, dtype=torch.bool, device=ids.device).triu(1)[None, None]
        logits = self.module(aligned, positions, attention_mask=causal)  # [B, S, V/tp]
        index = (first.clamp_min(0).unsqueeze(1) + torch.arange(R, device=ids.device)).unsqueeze(-1)
        return logits.gather(1, index.expand(B, R, logits.shape[-1]))[: len(batch)]

    def _token_logprobs(self, logits: torch.Tensor, targets: torch.Tensor, site: str, temperature: float) -> torch.Tensor:
        impl = self.ledger.impl("logprobs", site)
        vocab = self.layout.vocab_size
        if impl is not None and impl.name != DEFAULT_IMPLS["logprobs"].name:
            # An installed implementation (IsoExec) sees the full logits, as at tensor parallel 1,
            # so its result does not depend on the tensor-parallel degree.
            full = vp.gather_vocab(logits, self.tp_group)[..., :vocab]
            return token_logprobs(full, targets, ledger=self.ledger, temperature=temperature)
        if self.tp == 1:
            return token_logprobs(logits[..., :vocab], targets, ledger=self.ledger, temperature=temperature)
        self.ledger.observe("logprobs", site, DEFAULT_IMPLS["logprobs"].name)
        return vp.vocab_parallel_logprobs(
            _scaled(logits, temperature), targets, vocab_start=self.tp_rank * self.vocab_width, vocab_size=vocab, group=self.tp_group
        )

    def _response_logprobs(
        self, batch: TrainingBatch, temperature: float, site: str, with_entropy: bool, rows: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        R = batch.response_len
        logits = self._vocab_logits(batch, rows)
        targets = batch.input_ids[:, -R:]
        logprobs = self._token_logprobs(logits, targets, site, temperature)
        real = batch.attention_mask[:, -R:].bool()
        zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
        logprobs = torch.where(real, logprobs, zero)
        entropy = None
        if with_entropy:
            entropy = vp.vocab_parallel_entropy(
                _scaled(logits, temperature),
                vocab_start=self.tp_rank * self.vocab_width,
                vocab_size=self.layout.vocab_size,
                group=self.tp_group,
            )
            entropy = torch.where(real, entropy, zero)
        return logprobs, entropy

    def _plan(self, part: TrainingBatch) -> list[list[int]]:
        """Row indices of this replica's micro-batches: length-sorted, packed under the row and
        token caps (``skyrl_core.backends.packing``), no row split."""
        return plan_micro_batches(part, max_rows=self._micro_batch_size(), max_tokens=self.trainer.micro_batch_tokens) if len(part) else []

    def _passes(self, part: TrainingBatch, num_passes: int | None) -> list[TrainingBatch]:
        """This replica's micro-batches, then empty ones up to ``num_passes`` (expert parallelism:
        every rank of an expert group must enter the same collectives the same number of times)."""
        micro = [part.select(rows) for rows in self._plan(part)]
        if num_passes is None:
            return micro
        if len(micro) > num_passes:
            raise AssertionError(f"rank {self.rank} got {len(micro)} micro-batches, more than {num_passes}")
        return micro + [part.select(slice(0, 0))] * (num_passes - len(micro))

    def _pass_rows(self, num_passes: int | None) -> int | None:
        return None if num_passes is None else self._micro_batch_size()

    def forward(self, part: TrainingBatch, temperature: float, num_passes: int | None = None) -> torch.Tensor:
        """Logprobs ``[b, R]`` (fp32, CPU) of this replica's rows."""
        outputs = []
        with torch.no_grad(), site_scope("trainer_score"):
            for micro in self._passes(part, num_passes):
                micro = batch_to_device(micro, self.device)
                logprobs, _ = self._response_logprobs(micro, temperature, "trainer_score", False, self._pass_rows(num_passes))
                outputs.append(logprobs.float().cpu())
        # Micro-batches are length-sorted: rows go back to their places.
        return scatter_rows(list(zip(self._plan(part), outputs)), len(part), part.response_len)

    def forward_backward(
        self, part: TrainingBatch, loss_fn: LossFn, temperature: float, num_passes: int | None = None
    ) -> list[tuple[dict[str, float], float]]:
        """Per micro-batch of this replica's rows: ``({**metrics, "loss": loss}, trained tokens)``;
        gradients accumulate. The driver reduces the records once for the mini-batch. A call that
        fails part-way leaves the gradients as it found them (``p.grad``: the CPU optimizer's; the
        GPU path's ``main_grad`` buffers are not put back)."""
        with gradients_restored_on_failure(self.model.parameters()):
            return self._forward_backward(part, loss_fn, temperature, num_passes)

    def _forward_backward(
        self, part: TrainingBatch, loss_fn: LossFn, temperature: float, num_passes: int | None
    ) -> list[tuple[dict[str, float], float]]:
        wants_entropy = accepts_keyword(loss_fn, "entropy")
        results = []
        for micro in self._passes(part, num_passes):
            micro = batch_to_device(micro, self.device)
            with site_scope("trainer_forward"):
                logprobs, entropy = self._response_logprobs(
                    micro, temperature, "trainer_forward", wants_entropy and len(micro) > 0, self._pass_rows(num_passes)
                )
                if len(micro) == 0:  # an empty pass: joins the collectives, adds exactly zero gradient
                    (logprobs.sum() * 0.0).backward()
                    continue
                extra = {"entropy": entropy} if wants_entropy else {}
                loss, metrics = loss_fn(logprobs, micro, **extra)
                loss.backward()
            results.append(({**{k: float(v) for k, v in metrics.items()}, "loss": float(loss.detach())}, float(micro.loss_mask.sum())))
        return results

    def _micro_batch_size(self) -> int:
        return self.options.micro_batch_size or self.trainer.micro_batch_size

    def optim_step(self, hyperparams: OptimizerHyperparams | None = None) -> dict[str, float]:
        """One AdamW step: at the trainer config's schedule, or with ``hyperparams`` (the caller's
        lr, betas, eps, weight decay and clip for this step; CPU optimizer only)."""
        if hyperparams is None:
            lr = scheduled_lr(self.trainer, self.optimizer_steps, self.total_optimizer_steps)
            grad_norm = self.optimizer.step(lr)
        else:
            if not isinstance(self.optimizer, ShardedAdamW):  # pragma: no cover - needs CUDA
                raise ValueError("optim_step(hyperparams) is built for the megatron backend's CPU optimizer only")
            lr = hyperparams.lr
            grad_norm = self.optimizer.step(lr, betas=tuple(hyperparams.betas), eps=hyperparams.eps,
                                            weight_decay=hyperparams.weight_decay, grad_clip=hyperparams.grad_clip or math.inf)
        self.optimizer_steps += 1
        return {"grad_norm": grad_norm, "lr": lr}

    # --- weights and state -------------------------------------------------------------------

    def _local_weights(self) -> dict[str, torch.Tensor]:
        """This rank's parameters in fp32 on the CPU."""
        return {name: p.detach().float().cpu() for name, p in self.model.named_parameters()}

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 CPU weights by Hugging Face name on global rank 0 (``{}`` elsewhere).
        Collective over the tensor-parallel group (gathered on the compute device: nccl needs CUDA)."""
        adapter = self.adapter_state_dict() if self.options.lora is not None else {}  # (collective)
        shards: list[dict[str, torch.Tensor]] = [{} for _ in range(self.tp)]
        local_experts = self.layout.num_experts // self.ep
        for name, param in self.model.named_parameters():
            if lora.is_adapter_parameter(name):
                continue
            for r, part in enumerate(all_gather(param.detach().float().contiguous(), self.tp_group)):
                if ".local_experts." not in name:
                    shards[r][name] = part.cpu()
                    continue
                local = int(name.split(".local_experts.")[1].split(".")[0])
                # Expert-parallel rank k holds experts k * E / ep onwards.
                for k, expert in enumerate(all_gather(part, self.ep_group)):
                    shards[r][expert_name(name, k * local_experts + local)] = expert.cpu()
        if self.rank != 0:
            return {}
        weights = megatron_to_hf(shards, self.layout, fused_norms=self.use_transformer_engine)
        if self.options.lora is not None:
            weights = lora.merged(weights, adapter, self.options.lora)
        return weights

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter's own tensors under peft's names (fp32, CPU) on global rank 0; ``{}``
        elsewhere. Collective over the tensor-parallel group."""
        if self.options.lora is None:
            raise ValueError("export_adapter: this backend trains no LoRA adapter (backend.options.lora is not set)")
        adapter = lora.export(self.model, self.layout, self.options.lora.targets, tp=self.tp, tp_group=self.tp_group)
        return adapter if self.rank == 0 else {}

    def save_hf(self, path: str) -> None:
        """Rank 0 writes ``config.json`` and ``model.safetensors`` into the existing ``path``. Collective."""
        weights = self.hf_state_dict()
        if self.rank == 0:
            from skyrl_megatron.hf_dir import write_hf_dir

            write_hf_dir(path, weights, self.hf_config, tied=self.layout.tied_embeddings)
        dist.barrier()

    def save_checkpoint(self, path: str) -> None:
        """Each rank writes its shard, optimizer and RNG state; rank 0 the step and layout. Collective."""
        state = {
            "model": self._local_weights(),
            "optimizer": self.optimizer.state_dict(),
            "rng": _rng_state(),
        }
        save_state(os.path.join(path, shard_file(self.rank)), state)
        if self.rank == 0:
            meta = {
                "format": CHECKPOINT_FORMAT,
                "optimizer_steps": self.optimizer_steps,
                "tensor_parallel": self.tp,
                "expert_parallel": self.ep,
                "world_size": self.world_size,
                "layout": attrs.asdict(self.layout),
            }
            save_state(os.path.join(path, TRAINER_STATE_FILE), meta)
        dist.barrier()

    def load_checkpoint(self, path: str, optimizer: bool = True) -> None:
        """Restore what ``save_checkpoint`` wrote; without ``optimizer`` the weights only (the
        optimizer starts fresh, at step 0)."""
        meta = load_state(os.path.join(path, TRAINER_STATE_FILE))
        if meta.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{path}: checkpoint format {meta.get('format')!r}, this backend reads {CHECKPOINT_FORMAT}")
        written = (meta["tensor_parallel"], meta.get("expert_parallel", 1), meta["world_size"])
        if written != (self.tp, self.ep, self.world_size):
            raise ValueError(
                f"{path} was written with (tensor_parallel, expert_parallel, world_size)={written}; this backend "
                f"runs {(self.tp, self.ep, self.world_size)}. To change the layout, start from a save_hf directory "
                "(model.path) instead"
            )
        state = load_state(os.path.join(path, shard_file(self.rank)))
        load_parameters(self.model, state["model"])
        if optimizer:
            self.optimizer.load_state_dict(state["optimizer"])
            self.optimizer_steps = int(meta["optimizer_steps"])
        else:
            self.optimizer.reset()
            self.optimizer_steps = 0
        self.optimizer.zero_grad()
        _set_rng_state(state["rng"])

    def execution_contract(self) -> dict[str, Any]:
        import megatron.core

        return {
            "ledger": self.ledger.as_dict(),
            "backend": "megatron",
            "tensor_parallel": self.tp,
            "expert_parallel": self.ep,
            "world_size": self.world_size,
            "layer_spec": "transformer_engine" if self.use_transformer_engine else "local",
            "layer_spec_reason": self.layer_spec_reason,
            "mixed_precision": self.options.mixed_precision,
            "device": self.device.type,
            "torch": torch.__version__,
            "megatron_core": megatron.core.__version__,
            "threads": torch.get_num_threads(),
        }

    def ready(self) -> int:
        return self.rank

    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        for attr in ("optimizer", "module", "model"):
            self.__dict__.pop(attr, None)
        _release_parallel_state()


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 ``logits / temperature``, rounded as ``skyrl_core.ops.defaults.logprobs`` rounds it."""
    return logits.float() if temperature == 1.0 else logits.float() / temperature


def _rng_state() -> dict[str, Any]:
    """The process's generators plus megatron-core's RNG tracker (its model-parallel streams)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return {**capture_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    restore_rng_state(state)
    get_cuda_rng_tracker().set_states(state["tracker"])
