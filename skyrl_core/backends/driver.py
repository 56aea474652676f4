"""``RankDriver``: the ``TrainingBackend`` side of a backend whose ranks run in this process or as
Ray actors on this machine.

A backend plugin subclasses it and says how to start its ranks and what each rank gets; the driver
calls every rank together (results in rank order), splits a batch's rows across ranks, reduces the
ranks' micro-batch metrics (once, for the whole mini-batch), writes checkpoints and Hugging Face directories atomically
and handles closing: a failed call to Ray ranks kills them all (the others may be stuck in a
collective with the failed one) and closes the backend.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Iterator

import torch

from skyrl_core.backends.packing import combine_micro_metrics
from skyrl_core.directories import publish_directory
from skyrl_core.interfaces import LossFn
from skyrl_core.types import TrainingBatch


class RankDriver:
    """Base of a ``TrainingBackend`` driving ``world_size`` ranks: ``_local`` (a rank object in this
    process) or ``_actors`` (Ray actors, one per rank). See ``skyrl_core.interfaces.TrainingBackend``.

    A subclass sets ``world_size``, ``_local`` or ``_actors`` in its ``__init__`` (after calling
    ``RankDriver.__init__``), ``checkpoint_kind`` and ``state_file`` (the file that marks its
    checkpoints), and implements ``_call_actors``, ``_stop_actors``, ``_forward_args``,
    ``_forward_backward_args`` and ``export_weights``.
    """

    checkpoint_kind: str = "a"  # "an FSDP": load_checkpoint's error says "... is not an FSDP checkpoint"
    state_file: str = ""

    def __init__(self) -> None:
        self.world_size = 1
        self._local: Any = None
        self._actors: list[Any] = []
        self._closed = False

    # --- what a subclass provides ----------------------------------------------------------------

    def _call_actors(self, method: str, per_rank_args: list[tuple]) -> list[Any]:
        """Call ``method`` on every actor with its arguments; results in rank order."""
        raise NotImplementedError

    def _kill_actors(self) -> None:
        """Kill the actors at once (after a failed call)."""
        from skyrl_core.backends.ray_actors import kill

        kill(self._actors)

    def _stop_actors(self) -> None:
        """Stop the actors on ``close`` (kill them, or keep them for reuse)."""
        self._kill_actors()

    def _forward_args(self, batch: TrainingBatch, temperature: float) -> list[tuple]:
        """Each rank's arguments of its ``forward``."""
        raise NotImplementedError

    def _forward_backward_args(self, batch: TrainingBatch, loss_fn: LossFn, temperature: float) -> list[tuple]:
        """Each rank's arguments of its ``forward_backward``."""
        raise NotImplementedError

    def _replica_results(self, results: list[Any]) -> list[Any]:
        """The results that stand for distinct rows, in row order (every rank's by default)."""
        return results

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise NotImplementedError

    # --- fan-out ---------------------------------------------------------------------------------

    def _call(self, method: str, per_rank_args: list[tuple] | None = None) -> list[Any]:
        """Call ``method`` on every rank (rank r gets ``per_rank_args[r]``); results in rank order."""
        if self._closed:
            raise RuntimeError(f"this {type(self).__name__} is closed")
        args = per_rank_args or [()] * self.world_size
        if self._local is not None:
            return [getattr(self._local, method)(*args[0])]
        try:
            return self._call_actors(method, args)
        except BaseException:
            # The other ranks may be stuck in a collective with the failed one: nothing to save.
            self._kill_actors()
            self._actors = []
            self._closed = True
            raise

    # --- TrainingBackend -------------------------------------------------------------------------

    def forward(self, batch: TrainingBatch, temperature: float = 1.0) -> torch.Tensor:
        """Log-probabilities ``[B, R]`` (fp32, CPU) of the response tokens under ``logits / temperature``,
        without gradient, 0 on padding."""
        check_temperature(temperature)
        check_batch(batch)
        return torch.cat(self._replica_results(self._call("forward", self._forward_args(batch, temperature))))

    def forward_backward(self, batch: TrainingBatch, loss_fn: LossFn, temperature: float = 1.0) -> dict[str, float]:
        """Accumulate gradients of ``loss_fn`` over a whole mini-batch: the backend splits it into
        micro-batches (``trainer.micro_batch_size`` rows, ``trainer.micro_batch_tokens`` padded
        positions, no row split) on every rank.

        Returns the micro-batches' metrics reduced once (``skyrl_core.backends.packing.combine_micro_metrics``):
        ``"loss"`` is the sum of the micro-batch losses (the whole batch's loss when ``loss_fn``
        normalises with ``batch.token_weights``), ``*_max``/``*_min`` the extremes, every other metric
        ``loss_fn`` returned its mean weighted by trained tokens. A ``loss_fn`` with an ``entropy``
        parameter also receives the per-token entropy ``[b, R]`` of the same logits (with gradient,
        0 on padding).
        """
        check_temperature(temperature)
        check_batch(batch)
        results = self._call("forward_backward", self._forward_backward_args(batch, loss_fn, temperature))
        return combine_micro_metrics([record for rank_records in self._replica_results(results) for record in rank_records])

    def optim_step(self, hyperparams: Any = None) -> dict[str, float]:
        """``hyperparams`` (``OptimizerHyperparams``): this step's AdamW settings, for ranks that take them."""
        return self._call("optim_step", None if hyperparams is None else [(hyperparams,)] * self.world_size)[0]

    def save_checkpoint(self, path: str) -> None:
        """Write the checkpoint to ``path`` atomically: into a temporary sibling directory renamed
        into place when complete."""
        self._write_atomically(path, "save_checkpoint")

    def load_checkpoint(self, path: str, *, optimizer: bool = True) -> None:
        """``optimizer`` False: the weights only, the optimizer starts fresh (ranks that take it)."""
        if not os.path.isfile(os.path.join(path, self.state_file)):
            raise FileNotFoundError(f"{path!r} is not {self.checkpoint_kind} checkpoint (no {self.state_file})")
        args = (os.path.abspath(path),) if optimizer else (os.path.abspath(path), False)
        self._call("load_checkpoint", [args] * self.world_size)

    def save_hf(self, path: str) -> None:
        """Write a Hugging Face directory (``config.json``, ``model.safetensors``, ...) to ``path``
        (atomically, like checkpoints)."""
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
            self._stop_actors()
            self._actors = []

    def __enter__(self) -> Any:
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
            publish_directory(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def split_rows(batch: TrainingBatch, parts: int) -> list[TrainingBatch]:
    """``batch``'s rows in ``parts`` contiguous parts, as even as possible (the first ones longer)."""
    rows = len(batch)
    sizes = [rows // parts + (1 if p < rows % parts else 0) for p in range(parts)]
    out, start = [], 0
    for size in sizes:
        out.append(batch.select(slice(start, start + size)))
        start += size
    return out


def check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")


def check_batch(batch: TrainingBatch) -> None:
    """Raise ``ValueError`` unless ``batch`` has the shapes a backend needs (and at least one row)."""
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
