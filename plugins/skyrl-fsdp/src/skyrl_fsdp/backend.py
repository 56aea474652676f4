"""``FSDPBackend``: the ``TrainingBackend`` of skyrl-fsdp.

It drives ``options.world_size`` data-parallel ranks (``skyrl_fsdp.rank.FSDPRank``): one in this
process, or N Ray actors on this machine (``skyrl_core.backends.driver.RankDriver`` does the
fan-out). Batches are split by rows across ranks (contiguous, as even as possible); ``forward``
gathers the rows back in order; gradients are summed across ranks by FSDP.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from skyrl_core.backends.driver import RankDriver, split_rows
from skyrl_core.backends.packing import plan_micro_batches
from skyrl_core.backends.rank_setup import wants_gpu
from skyrl_core.config.schema import ModelConfig, TrainerConfig
from skyrl_core.interfaces import LossFn
from skyrl_core.types import TrainingBatch
from skyrl_fsdp.options import FSDPOptions
from skyrl_fsdp.precision import with_model_precision
from skyrl_fsdp.rank import TRAINER_STATE_FILE, FSDPRank


class FSDPBackend(RankDriver):
    """FSDP2 training backend. See ``skyrl_core.interfaces.TrainingBackend`` for the contract.

    ``trainer`` supplies lr, schedule, warm-up, weight decay, gradient clipping, micro-batch caps
    (``micro_batch_size`` rows and ``micro_batch_tokens`` padded positions per forward pass on each
    rank), ``logprob_chunk_tokens``, ``activation_checkpointing`` and the number of steps the
    schedule spans (``steps * mini_batches * ppo_epochs`` optimizer steps).

    ``forward_backward`` takes a whole mini-batch: each rank packs its rows into length-sorted
    micro-batches (``skyrl_core.backends.packing``). Each micro-batch reaching a ``loss_fn`` is
    trimmed of the columns that are padding in all its rows, so its ``[b, r]`` tensors (logprobs
    included) have its own longest response ``r``; its logprobs are computed only where its loss
    mask is set.
    ``save_checkpoint`` writes weights (a Hugging Face directory), optimizer, step and RNG state;
    ``save_hf`` also writes the tokenizer when the model has one.
    """

    checkpoint_kind = "an FSDP"
    packed_rows = True  # scores TrainingBatch.position_ids (packed rows, skyrl sft)
    state_file = TRAINER_STATE_FILE

    def __init__(
        self,
        model: ModelConfig,
        options: FSDPOptions | dict[str, Any] | None = None,
        *,
        seed: int = 0,
        trainer: TrainerConfig | None = None,
    ) -> None:
        super().__init__()
        if options is None:
            options = FSDPOptions()
        elif isinstance(options, dict):
            options = FSDPOptions(**options)
        options = self.options = with_model_precision(options, model)  # "auto" follows model.dtype
        self.trainer = trainer or TrainerConfig()
        self.world_size = options.world_size
        self._use_gpu = wants_gpu(options.device)
        self._prompt_pair_cost: float | None = None
        if self.world_size == 1:
            self._local = FSDPRank(model, options, self.trainer, seed=seed)
        else:
            from skyrl_fsdp.ray_ranks import start_ranks

            self._actors = start_ranks(model, options, self.trainer, seed=seed, use_gpu=self._use_gpu)

    # --- RankDriver ------------------------------------------------------------------------------

    def _call_actors(self, method: str, per_rank_args: list[tuple]) -> list[Any]:
        from skyrl_fsdp.ray_ranks import call_ranks

        return call_ranks(self._actors, method, per_rank_args)

    def _stop_actors(self) -> None:
        from skyrl_fsdp.ray_ranks import stop_ranks

        stop_ranks(self._actors, reuse=self.options.reuse_workers, use_gpu=self._use_gpu)

    def _split(self, batch: TrainingBatch) -> list[tuple[TrainingBatch, list[list[int]], int, TrainingBatch | None]]:
        """Per-rank ``(rows, micro-batch plan, micro-batches every rank runs, filler)`` arguments."""
        parts = split_rows(batch, self.world_size)
        if self._prompt_pair_cost is None:  # the ranks' model and op sites decide (0: rows apart)
            self._prompt_pair_cost = float(self._call("prompt_pair_cost")[0])
        sharing = self._prompt_pair_cost or None
        plans = [plan_micro_batches(part, max_rows=self.trainer.micro_batch_size, max_tokens=self.trainer.micro_batch_tokens,
                                    prompt_pair_cost=sharing if part.position_ids is None else None)
                 if len(part) else [] for part in parts]
        num_micro = max(len(plan) for plan in plans)
        filler = batch.select([0]) if any(len(plan) < num_micro for plan in plans) else None
        return [(part, plan, num_micro, filler) for part, plan in zip(parts, plans)]

    def _forward_args(self, batch: TrainingBatch, temperature: float) -> list[tuple]:
        return [(part, temperature, plan, n, filler) for part, plan, n, filler in self._split(batch)]

    def _forward_backward_args(self, batch: TrainingBatch, loss_fn: LossFn, temperature: float) -> list[tuple]:
        return [(part, loss_fn, plan, n, filler, temperature) for part, plan, n, filler in self._split(batch)]

    def export_adapter(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter's own tensors (peft names, fp32, CPU) of ``options.lora``."""
        if self.options.lora is None:
            raise ValueError("export_adapter: this backend trains no LoRA adapter (backend.options.lora is not set)")
        return self._call("adapter_state_dict")[0]

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full fp32 weights on CPU by Hugging Face name, in ``state_dict`` order (tied names included)."""
        return iter(self._call("full_state_dict")[0].items())
