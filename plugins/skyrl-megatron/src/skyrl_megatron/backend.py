"""``MegatronBackend``: the ``TrainingBackend`` of skyrl-megatron.

It drives ``options.processes`` ranks (``skyrl_megatron.rank.MegatronRank``): one in this process,
or N Ray actors on this machine. Rows of a batch are split contiguously (as evenly as possible)
across data-parallel replicas; every tensor-parallel rank of a replica gets the same rows.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import uuid
from typing import Any, Iterator

import torch

from skyrl_core.config.schema import ModelConfig, TrainerConfig
from skyrl_core.interfaces import LossFn
from skyrl_core.types import TrainingBatch
from skyrl_megatron.options import MegatronOptions
from skyrl_megatron.rank import TRAINER_STATE_FILE, MegatronRank


class MegatronBackend:
    """Megatron-core training backend. See ``skyrl_core.interfaces.TrainingBackend`` for the contract.

    ``trainer`` supplies lr, schedule, warm-up, weight decay, gradient clipping, micro-batch size
    (unless ``options.micro_batch_size`` is set) and the number of steps the schedule spans
    (``steps * mini_batches * ppo_epochs`` optimizer steps).
    """

    def __init__(
        self,
        model: ModelConfig,
        options: MegatronOptions | dict[str, Any] | None = None,
        *,
        seed: int = 0,
        trainer: TrainerConfig | None = None,
    ) -> None:
        if options is None:
            options = MegatronOptions()
        elif isinstance(options, dict):
            options = MegatronOptions(**options)
        self.options = options
        self.trainer = trainer or TrainerConfig()
        self.world_size = options.processes
        self._local: MegatronRank | None = None
        self._actors: list[Any] = []
        self._closed = False
        in_process = options.launcher == "inprocess" or (options.launcher == "auto" and self.world_size == 1)
        if in_process:
            self._local = MegatronRank(model, options, self.trainer, seed=seed)
        else:
            from skyrl_megatron.ray_ranks import start_ranks

            use_gpu = options.device == "cuda" or (options.device == "auto" and torch.cuda.is_available())
            self._actors = start_ranks(model, options, self.trainer, seed=seed, use_gpu=use_gpu)

    # --- fan-out ---------------------------------------------------------------------------------

    def _call(self, method: str, per_rank_args: list[tuple] | None = None) -> list[Any]:
        """Call ``method`` on every rank (rank r gets ``per_rank_args[r]``); results in rank order."""
        if self._closed:
            raise RuntimeError("this MegatronBackend is closed")
        args = per_rank_args or [()] * self.world_size
        if self._local is not None:
            return [getattr(self._local, method)(*args[0])]
        from skyrl_megatron.ray_ranks import gather

        refs = [getattr(actor, method).remote(*args[r]) for r, actor in enumerate(self._actors)]
        try:
            return gather(refs)
        except BaseException:
            # The other ranks may be stuck in a collective with the failed one: nothing to save.
            self.close()
            raise

    def _replica_parts(self, batch: TrainingBatch) -> list[TrainingBatch]:
        _check_batch(batch)
        replicas = self.options.data_parallel
        rows = len(batch)
        sizes = [rows // replicas + (1 if d < rows % replicas else 0) for d in range(replicas)]
        parts, start = [], 0
        for size in sizes:
            parts.append(batch.select(slice(start, start + size)))
            start += size
        return parts

    def _per_rank(self, parts: list[TrainingBatch], *extra: Any) -> list[tuple]:
        """Each rank's arguments: its replica's rows, ``extra``, and the number of passes every rank
        runs (expert parallelism only; None otherwise)."""
        tp = self.options.tensor_parallel
        passes = None
        if self.options.expert_parallel > 1:
            size = self.options.micro_batch_size or self.trainer.micro_batch_size
            passes = max(math.ceil(len(part) / size) for part in parts)
        return [(parts[rank // tp], *extra, passes) for rank in range(self.world_size)]

    def _replica_results(self, results: list[Any]) -> list[Any]:
        """One result per replica: its tensor-parallel rank 0's."""
        return results[:: self.options.tensor_parallel]

    # --- TrainingBackend -------------------------------------------------------------------------

    def forward(self, batch: TrainingBatch, temperature: float = 1.0) -> torch.Tensor:
        """Log-probabilities ``[B, R]`` (fp32, CPU) of the response tokens under ``logits / temperature``,
        without gradient, 0 on padding."""
        _check_temperature(temperature)
        results = self._call("forward", self._per_rank(self._replica_parts(batch), temperature))
        return torch.cat(self._replica_results(results))

    def forward_backward(self, batch: TrainingBatch, loss_fn: LossFn, temperature: float = 1.0) -> dict[str, float]:
        """Accumulate gradients of ``loss_fn`` over every micro-batch of ``batch``.

        Returns the mean over micro-batches of each metric ``loss_fn`` returned, and ``"loss"``: the
        sum of the micro-batch losses. A ``loss_fn`` with an ``entropy`` parameter also receives the
        per-token entropy ``[b, R]`` (with gradient, 0 on padding).
        """
        _check_temperature(temperature)
        results = self._call("forward_backward", self._per_rank(self._replica_parts(batch), loss_fn, temperature))
        micro = [metrics for replica in self._replica_results(results) for metrics in replica]
        out: dict[str, float] = {}
        for key in dict.fromkeys(k for metrics in micro for k in metrics):
            values = [metrics[key] for metrics in micro if key in metrics]
            out[key] = sum(values) if key == "loss" else sum(values) / len(values)
        return out

    def optim_step(self) -> dict[str, float]:
        return self._call("optim_step")[0]

    def save_checkpoint(self, path: str) -> None:
        """Write every rank's shard, optimizer and RNG state and the step to ``path``, atomically
        (into a temporary sibling directory renamed into place when complete). Reloads at the same
        tensor-parallel degree and world size."""
        self._write_atomically(path, "save_checkpoint")

    def load_checkpoint(self, path: str) -> None:
        if not os.path.isfile(os.path.join(path, TRAINER_STATE_FILE)):
            raise FileNotFoundError(f"{path!r} is not a Megatron checkpoint (no {TRAINER_STATE_FILE})")
        self._call("load_checkpoint", [(os.path.abspath(path),)] * self.world_size)

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full fp32 weights on CPU by Hugging Face name, in transformers' ``state_dict`` order
        (``lm_head.weight`` included when tied)."""
        return iter(self._call("hf_state_dict")[0].items())

    def save_hf(self, path: str) -> None:
        """Write ``config.json`` and ``model.safetensors`` to ``path`` (atomically, like checkpoints)."""
        self._write_atomically(path, "save_hf")

    def execution_contract(self) -> dict[str, Any]:
        return self._call("execution_contract")[0]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._local is not None:
            self._local.close()
            self._local = None
        if self._actors:
            from skyrl_megatron.ray_ranks import kill

            kill(self._actors)
            self._actors = []

    def __enter__(self) -> MegatronBackend:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- helpers ---------------------------------------------------------------------------------

    def _write_atomically(self, path: str, method: str) -> None:
        path = os.path.abspath(path)
        parent = os.path.dirname(path)
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
        os.chmod(tmp, 0o755)
        try:
            self._call(method, [(tmp,)] * self.world_size)
            if os.path.exists(path):
                old = f"{path}.old-{uuid.uuid4().hex[:8]}"
                os.rename(path, old)
                os.rename(tmp, path)
                shutil.rmtree(old)
            else:
                os.rename(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")


def _check_batch(batch: TrainingBatch) -> None:
    if batch.input_ids.ndim != 2 or batch.attention_mask.shape != batch.input_ids.shape:
        raise ValueError(
            f"input_ids and attention_mask must both be [B, P + R]; got {tuple(batch.input_ids.shape)} "
            f"and {tuple(batch.attention_mask.shape)}"
        )
    if len(batch) == 0:
        raise ValueError("the batch is empty")
    if batch.loss_mask.ndim != 2 or batch.loss_mask.shape[0] != len(batch):
        raise ValueError(f"loss_mask must be [B, R] with B={len(batch)}; got {tuple(batch.loss_mask.shape)}")
    if batch.prompt_len < 1:
        raise ValueError(
            f"responses of length {batch.response_len} leave no prompt token in input_ids of length "
            f"{batch.input_ids.shape[1]}: the first response token needs a prompt token before it"
        )
