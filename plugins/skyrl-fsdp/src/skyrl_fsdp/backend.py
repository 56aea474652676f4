"""``FSDPBackend``: the ``TrainingBackend`` of skyrl-fsdp.

It drives ``options.world_size`` data-parallel ranks (``skyrl_fsdp.rank.FSDPRank``): one in this
process, or N Ray actors on this machine. Batches are split by rows across ranks (contiguous, as even
as possible); ``forward`` gathers the rows back in order; gradients are summed across ranks by FSDP.
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
from skyrl_fsdp.options import FSDPOptions
from skyrl_fsdp.rank import TRAINER_STATE_FILE, FSDPRank


class FSDPBackend:
    """FSDP2 training backend. See ``skyrl_core.interfaces.TrainingBackend`` for the contract.

    ``trainer`` supplies lr, schedule, warm-up, weight decay, gradient clipping, micro-batch size
    (sequences per forward pass on each rank) and the number of steps the schedule spans
    (``steps * mini_batches * ppo_epochs`` optimizer steps).
    """

    def __init__(
        self,
        model: ModelConfig,
        options: FSDPOptions | dict[str, Any] | None = None,
        *,
        seed: int = 0,
        trainer: TrainerConfig | None = None,
    ) -> None:
        if options is None:
            options = FSDPOptions()
        elif isinstance(options, dict):
            options = FSDPOptions(**options)
        self.options = options
        self.trainer = trainer or TrainerConfig()
        self.world_size = options.world_size
        self._local: FSDPRank | None = None
        self._hosts: list[Any] = []
        self._closed = False
        self._use_gpu = options.device == "cuda" or (options.device == "auto" and torch.cuda.is_available())
        if self.world_size == 1:
            self._local = FSDPRank(model, options, self.trainer, seed=seed)
        else:
            from skyrl_fsdp.ray_ranks import start_ranks

            self._hosts = start_ranks(model, options, self.trainer, seed=seed, use_gpu=self._use_gpu)

    # --- fan-out ---------------------------------------------------------------------------------

    def _call(self, method: str, per_rank_args: list[tuple] | None = None, **kwargs: Any) -> list[Any]:
        """Call ``method`` on every rank (rank r gets ``per_rank_args[r]``); results in rank order."""
        if self._closed:
            raise RuntimeError("this FSDPBackend is closed")
        args = per_rank_args or [()] * self.world_size
        if self._local is not None:
            return [getattr(self._local, method)(*args[0], **kwargs)]
        from skyrl_fsdp.ray_ranks import call_ranks, kill

        try:
            return call_ranks(self._hosts, method, args, **kwargs)
        except BaseException:
            # The other ranks may be stuck in a collective with the failed one: nothing to save.
            kill(self._hosts)
            self._hosts = []
            self._closed = True
            raise

    def _split(self, batch: TrainingBatch) -> list[tuple[TrainingBatch, int, TrainingBatch | None]]:
        """Per-rank ``(rows, micro-batches every rank runs, filler)`` arguments."""
        _check_batch(batch)
        rows, ranks, mbs = len(batch), self.world_size, self.trainer.micro_batch_size
        sizes = [rows // ranks + (1 if r < rows % ranks else 0) for r in range(ranks)]
        num_micro = max(math.ceil(size / mbs) for size in sizes)
        filler = batch.select([0]) if any(math.ceil(size / mbs) < num_micro for size in sizes) else None
        parts, start = [], 0
        for size in sizes:
            parts.append(batch.select(slice(start, start + size)))
            start += size
        return [(part, num_micro, filler) for part in parts]

    # --- TrainingBackend -------------------------------------------------------------------------

    def forward(self, batch: TrainingBatch, temperature: float = 1.0) -> torch.Tensor:
        """Log-probabilities ``[B, R]`` (fp32, CPU) of the response tokens under ``logits / temperature``,
        without gradient, 0 on padding."""
        _check_temperature(temperature)
        per_rank = self._split(batch)
        return torch.cat(self._call("forward", [(part, temperature, n, filler) for part, n, filler in per_rank]))

    def forward_backward(self, batch: TrainingBatch, loss_fn: LossFn, temperature: float = 1.0) -> dict[str, float]:
        """Accumulate gradients of ``loss_fn`` over every micro-batch of ``batch`` on every rank.

        Each micro-batch reaching ``loss_fn`` is trimmed of the columns that are padding in all its
        rows, so its ``[b, r]`` tensors (logprobs included) have its own longest response ``r``.

        Returns the mean over micro-batches of each metric ``loss_fn`` returned, and ``"loss"``: the
        sum of the micro-batch losses (the whole batch's loss when ``loss_fn`` normalises with
        ``batch.token_weights``). A ``loss_fn`` with an ``entropy`` parameter also receives the
        per-token entropy ``[b, R]`` of the same logits (with gradient, 0 on padding).
        """
        _check_temperature(temperature)
        per_rank = self._split(batch)
        results = self._call(
            "forward_backward", [(part, loss_fn, n, filler, temperature) for part, n, filler in per_rank]
        )
        micro = [metrics for rank_metrics in results for metrics in rank_metrics]
        out: dict[str, float] = {}
        for key in dict.fromkeys(k for metrics in micro for k in metrics):
            values = [metrics[key] for metrics in micro if key in metrics]
            out[key] = sum(values) if key == "loss" else sum(values) / len(values)
        return out

    def optim_step(self) -> dict[str, float]:
        return self._call("optim_step")[0]

    def save_checkpoint(self, path: str) -> None:
        """Write weights (a Hugging Face directory), optimizer, step and RNG state to ``path``,
        atomically: into a temporary sibling directory renamed into place when complete."""
        self._write_atomically(path, "save_checkpoint")

    def load_checkpoint(self, path: str) -> None:
        if not os.path.isfile(os.path.join(path, TRAINER_STATE_FILE)):
            raise FileNotFoundError(f"{path!r} is not an FSDP checkpoint (no {TRAINER_STATE_FILE})")
        self._call("load_checkpoint", [(os.path.abspath(path),)] * self.world_size)

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full fp32 weights on CPU by Hugging Face name, in ``state_dict`` order (tied names included)."""
        return iter(self._call("full_state_dict")[0].items())

    def save_hf(self, path: str) -> None:
        """Write ``config.json``, ``model.safetensors`` and the tokenizer (when the model has one) to
        ``path`` (atomically, like checkpoints)."""
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
        if self._hosts:
            from skyrl_fsdp.ray_ranks import stop_ranks

            stop_ranks(self._hosts, reuse=self.options.reuse_workers, use_gpu=self._use_gpu)
            self._hosts = []

    def __enter__(self) -> FSDPBackend:
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
