"""``MegatronBackend``: the ``TrainingBackend`` of skyrl-megatron.

It drives ``options.processes`` ranks (``skyrl_megatron.rank.MegatronRank``): one in this process,
or N Ray actors on this machine (``skyrl_core.backends.driver.RankDriver`` does the fan-out). Rows
of a batch are split contiguously (as evenly as possible) across data-parallel replicas; every
tensor-parallel rank of a replica gets the same rows.
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
from skyrl_megatron.options import MegatronOptions
from skyrl_megatron.rank import TRAINER_STATE_FILE, MegatronRank


class MegatronBackend(RankDriver):
    """Megatron-core training backend. See ``skyrl_core.interfaces.TrainingBackend`` for the contract.

    ``trainer`` supplies lr, schedule, warm-up, weight decay, gradient clipping, micro-batch caps
    (``micro_batch_size`` rows unless ``options.micro_batch_size`` is set, ``micro_batch_tokens``
    padded positions) and the number of steps the schedule spans (``steps * mini_batches *
    ppo_epochs`` optimizer steps). ``forward_backward`` takes a whole mini-batch; each replica packs
    its rows into length-sorted micro-batches. ``trainer.activation_checkpointing`` is refused.

    ``save_checkpoint`` writes every rank's shard, optimizer and RNG state and the step; it reloads
    at the same tensor-parallel degree and world size. ``save_hf`` writes ``config.json`` and
    ``model.safetensors``.
    """

    checkpoint_kind = "a Megatron"
    state_file = TRAINER_STATE_FILE

    def __init__(
        self,
        model: ModelConfig,
        options: MegatronOptions | dict[str, Any] | None = None,
        *,
        seed: int = 0,
        trainer: TrainerConfig | None = None,
    ) -> None:
        super().__init__()
        if options is None:
            options = MegatronOptions()
        elif isinstance(options, dict):
            options = MegatronOptions(**options)
        self.options = options
        self.trainer = trainer or TrainerConfig()
        if self.trainer.activation_checkpointing:
            raise ValueError("trainer.activation_checkpointing=true is not built for the megatron backend "
                             "(it is for fsdp); set it to false")
        self.world_size = options.processes
        in_process = options.launcher == "inprocess" or (options.launcher == "auto" and self.world_size == 1)
        if in_process:
            self._local = MegatronRank(model, options, self.trainer, seed=seed)
        else:
            from skyrl_megatron.ray_ranks import start_ranks

            self._actors = start_ranks(model, options, self.trainer, seed=seed, use_gpu=wants_gpu(options.device))

    # --- RankDriver ------------------------------------------------------------------------------

    def _call_actors(self, method: str, per_rank_args: list[tuple]) -> list[Any]:
        from skyrl_megatron.ray_ranks import gather

        return gather([getattr(actor, method).remote(*per_rank_args[r]) for r, actor in enumerate(self._actors)])

    def _per_rank(self, batch: TrainingBatch, *extra: Any) -> list[tuple]:
        """Each rank's arguments: its replica's rows, ``extra``, and the number of passes every rank
        runs (expert parallelism only; None otherwise)."""
        parts = split_rows(batch, self.options.data_parallel)
        tp = self.options.tensor_parallel
        passes = None
        if self.options.expert_parallel > 1:
            size = self.options.micro_batch_size or self.trainer.micro_batch_size
            passes = max(len(plan_micro_batches(part, max_rows=size, max_tokens=self.trainer.micro_batch_tokens))
                         if len(part) else 0 for part in parts)
        return [(parts[rank // tp], *extra, passes) for rank in range(self.world_size)]

    def _forward_args(self, batch: TrainingBatch, temperature: float) -> list[tuple]:
        return self._per_rank(batch, temperature)

    def _forward_backward_args(self, batch: TrainingBatch, loss_fn: LossFn, temperature: float) -> list[tuple]:
        return self._per_rank(batch, loss_fn, temperature)

    def _replica_results(self, results: list[Any]) -> list[Any]:
        """One result per replica: its tensor-parallel rank 0's."""
        return results[:: self.options.tensor_parallel]

    def export_adapter(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter's own tensors (peft names, fp32, CPU) of ``options.lora``."""
        if self.options.lora is None:
            raise ValueError("export_adapter: this backend trains no LoRA adapter (backend.options.lora is not set)")
        return self._call("adapter_state_dict")[0]

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full fp32 weights on CPU by Hugging Face name, in transformers' ``state_dict`` order
        (``lm_head.weight`` included when tied)."""
        return iter(self._call("hf_state_dict")[0].items())
