"""The Protocols that plugins implement. The core depends on these, never on a plugin.

Contract test-suites for each live in ``skyrl_core.testing``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    import torch

    from skyrl_core.types import GeneratedSample, GenerationRequest, Message, StepResult, TrainingBatch

# (logprobs [B,R] with grad, micro-batch) -> (scalar loss to backpropagate, metrics)
LossFn = Callable[["torch.Tensor", "TrainingBatch"], "tuple[torch.Tensor, dict[str, float]]"]


@runtime_checkable
class InferenceEngine(Protocol):
    """Generates samples from token ids. Built by an ``InferenceEngineSpec`` factory.

    Optional class attributes say what the engine supports (absent: False): ``supports_pause``
    (``pause``/``resume``, concurrent ``generate`` calls, ``update_weights(..., version=)``),
    ``supports_kv_recompute`` (``recompute_kv``) and ``supports_separate_process`` (built inside a
    Ray actor for ``engine.placement: separate``).
    """

    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[GeneratedSample]]:
        """One list of ``request.sampling.n`` samples per request, in request order.

        Sampling is seeded per request: the same request with the same seed gives the same samples
        whatever else is in the batch.
        """

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights in place (Hugging Face parameter names); drop any cached prefixes.

        An engine with ``supports_pause`` also takes ``version=`` (the policy version stamped on
        every token chosen afterwards, ``GeneratedSample.token_versions``) and may be called while
        paused: in-flight samples then continue under the new weights.
        """

    def pause(self) -> None:
        """Stop in-flight samples at a token boundary, keeping their state (KV cache); return once
        stopped. Engines that cannot (``supports_pause = False``) raise ``NotImplementedError``."""

    def resume(self) -> None:
        """Continue the samples ``pause`` stopped."""

    def recompute_kv(self) -> None:
        """(``supports_kv_recompute``; call while paused, after ``update_weights``.) Drop the keys/values
        of every in-flight sample and every cached prefix: before its next token each sample computes
        them again from its tokens so far (prompt + chosen) under the weights loaded then, so every
        later token is sampled by exactly the loaded policy over its whole context."""

    def execution_contract(self) -> dict[str, Any]:
        """What this engine installed at each op site (see ``skyrl_core.ops``), JSON-able."""

    def sleep(self) -> None:
        """Release memory held for generation (KV cache); weights may stay."""

    def wake(self) -> None:
        """Undo ``sleep``."""

    def close(self) -> None:
        """Free every resource; idempotent."""


@runtime_checkable
class TrainingBackend(Protocol):
    """Trains a policy (Tinker-shaped). Built by a ``TrainingBackendSpec`` factory."""

    def forward(self, batch: TrainingBatch, temperature: float = 1.0) -> torch.Tensor:
        """Log-probabilities ``[B, R]`` of the response tokens, without gradient (0 on padding)."""

    def forward_backward(self, batch: TrainingBatch, loss_fn: LossFn) -> dict[str, float]:
        """Accumulate gradients of ``loss_fn`` over a whole mini-batch ``batch``; return its metrics.

        The backend alone splits ``batch`` into micro-batches (by ``trainer.micro_batch_size`` rows
        and ``trainer.micro_batch_tokens`` padded positions, never splitting a row) and reduces their
        metrics once: ``loss`` summed (so a loss normalised over the whole batch must use
        ``batch.token_weights``), ``*_max``/``*_min`` extremes, the rest a trained-token mean.
        """

    def optim_step(self) -> dict[str, float]:
        """Clip gradients, step the optimizer and the LR schedule, zero gradients; return
        ``{"grad_norm": ..., "lr": ...}``. A backend that accepts ``hyperparams``
        (``skyrl_core.types.OptimizerHyperparams``, skyrl-fsdp) uses them for this step instead of
        the trainer config's learning rate, schedule, betas, eps, weight decay and clip."""

    def save_checkpoint(self, path: str) -> None:
        """Write model, optimizer, scheduler and RNG state to the directory ``path``."""

    def load_checkpoint(self, path: str) -> None:
        """Restore exactly what ``save_checkpoint`` wrote."""

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) weights by Hugging Face name, for weight sync."""

    def save_hf(self, path: str) -> None:
        """Write a Hugging Face model directory (safetensors + config) that transformers loads."""

    def execution_contract(self) -> dict[str, Any]:
        """What this backend installed at each op site, JSON-able."""

    def close(self) -> None:
        """Free every resource (process groups, actors); idempotent."""


@runtime_checkable
class Environment(Protocol):
    """A task: ``reset`` gives the prompt, ``step`` judges the model's turn."""

    def reset(self, sample: dict[str, Any]) -> list[Message]:
        """Start an episode for a dataset row; return the initial chat messages (the prompt)."""

    def step(self, action_text: str) -> StepResult:
        """Consume the model's turn; return ``(observation, reward, done, info)``."""


class PolicyLoss(Protocol):
    """``(logprobs, old_logprobs, advantages, loss_mask, rollout_logprobs=None) -> (loss, metrics)``.

    All tensors ``[B, R]``. Optional keywords: ``token_weights`` (per-token weights, from
    ``skyrl_core.algorithms.reduction_weights``, replacing the built-in reduction so that
    micro-batches sum exactly), ``values``/``returns`` where relevant.
    """

    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        loss_mask: torch.Tensor,
        rollout_logprobs: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict[str, float]]: ...


class AdvantageEstimator(Protocol):
    """``(token_rewards, response_mask, group_ids, values=None) -> (advantages, returns)``, ``[B, R]``."""

    def __call__(
        self,
        token_rewards: torch.Tensor,
        response_mask: torch.Tensor,
        group_ids: Sequence[Any],
        values: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...
