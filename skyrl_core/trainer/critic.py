"""PPO's critic: a value model trained beside the policy, whose values ``gae`` reads.

The critic is a transformers decoder body (a copy of the policy's model, or ``algorithm.critic.path``)
with a linear value head starting at zero, its own AdamW optimizer (``algorithm.critic.lr``,
constant) and the trainer's gradient clipping. It runs in the trainer process, in fp32, on the CPU,
whatever the policy's backend: it shares no parameter or gradient with the policy.

Alignment: the value of response token ``t`` is the head applied to the hidden state of the
position that predicts it (``P - 1 + t``), i.e. the state before token ``t`` is chosen, as the
policy's logprob of token ``t`` is read from the same position. Values are 0 where ``loss_mask`` is 0.

Training: every policy mini-batch also trains the critic once, with the clipped value loss of
``skyrl_core.algorithms.critic.value_loss`` (``algorithm.value_clip``) against the estimator's
returns, old values being those computed before the step's first update; rows go through in
``trainer.micro_batch_size`` micro-batches whose losses sum to the mini-batch's token mean.
Metrics ``critic/*``: the loss's, ``grad_norm`` and ``explained_variance`` of the old values.

Checkpoint (``critic/`` in a trainer checkpoint): ``model.safetensors`` (body and head by module
name), ``optimizer.safetensors`` and ``critic_state.json`` (format, optimizer steps).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import attrs
import torch

from skyrl_core.algorithms.critic import value_loss
from skyrl_core.algorithms.reductions import reduction_weights
from skyrl_core.config.schema import Config, ModelConfig
from skyrl_core.types import TrainingBatch

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "critic_state.json"
FORMAT = 1


class ValueModel(torch.nn.Module):
    """A decoder body and a linear value head: ``values(batch)`` is ``[B, R]``."""

    def __init__(self, model: ModelConfig, *, seed: int) -> None:
        super().__init__()
        from skyrl_core.models import load_causal_lm

        lm = load_causal_lm(attrs.evolve(model, dtype="float32"), seed=seed)
        self.body = lm.base_model  # the decoder without the LM head
        self.head = torch.nn.Linear(lm.config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)  # values start at 0: the first GAE is Monte-Carlo returns
        torch.nn.init.zeros_(self.head.bias)
        self.eval()  # dropout off, as for the policy

    def forward(self, batch: TrainingBatch) -> torch.Tensor:
        R = batch.response_len
        position_ids = batch.position_ids
        if position_ids is None:  # left-padded prompts: positions count real tokens only
            position_ids = (batch.attention_mask.long().cumsum(-1) - 1).clamp_min(0)
        hidden = self.body(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                           position_ids=position_ids).last_hidden_state
        before_each_response_token = hidden[:, -R - 1:-1]
        values = self.head(before_each_response_token).squeeze(-1)
        return torch.where(batch.loss_mask > 0, values, torch.zeros_like(values))


class Critic:
    """The value model of a run, its optimizer and its checkpoint."""

    def __init__(self, cfg: Config, model: ModelConfig) -> None:
        critic = cfg.algorithm.critic
        if critic.path is not None:
            model = attrs.evolve(model, path=critic.path, config=None, tokenizer=None)
        self.model = ValueModel(model, seed=cfg.trainer.seed)
        self.clip = cfg.algorithm.value_clip
        self.grad_clip = cfg.trainer.grad_clip
        self.micro_batch_size = cfg.trainer.micro_batch_size
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=critic.lr, weight_decay=0.0)
        self.optimizer_steps = 0

    def values(self, batch: TrainingBatch) -> torch.Tensor:
        """Values ``[B, R]`` without gradient (the old values of this step's updates)."""
        with torch.no_grad():
            return torch.cat([self.model(batch.select(slice(start, start + self.micro_batch_size)))
                              for start in range(0, len(batch), self.micro_batch_size)])

    def train_step(self, mini: TrainingBatch) -> dict[str, float]:
        """One optimizer step on mini-batch ``mini`` (with ``values`` and ``returns``); its metrics."""
        if mini.values is None or mini.returns is None:
            raise ValueError("the critic trains on a batch with values and returns")
        weights = reduction_weights(mini.loss_mask, "token_mean")  # over the whole mini-batch
        total, sums = 0.0, {"vf_clip_frac": 0.0, "value_mean": 0.0, "value_error": 0.0}
        tokens = float(mini.loss_mask.sum().clamp(min=1))
        for start in range(0, len(mini), self.micro_batch_size):
            rows = slice(start, start + self.micro_batch_size)
            micro = mini.select(rows)
            loss, metrics = value_loss(self.model(micro), micro.values, micro.returns, micro.loss_mask,
                                       clip=self.clip, token_weights=weights[rows])
            loss.backward()
            total += float(loss.detach())
            share = float(micro.loss_mask.sum()) / tokens
            for key in sums:
                sums[key] += float(metrics[key]) * share
        norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip))
        sums["explained_variance"] = explained_variance(mini.values, mini.returns, mini.loss_mask)
        if math.isfinite(norm):  # like the policy: a non-finite gradient skips the update
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        return {"critic/value_loss": total, "critic/grad_norm": norm, **{f"critic/{k}": v for k, v in sums.items()}}

    # --- checkpoint ------------------------------------------------------------------------------

    def save(self, path: str) -> None:
        from skyrl_core.state_file import save_state

        os.makedirs(path, exist_ok=True)
        save_state(os.path.join(path, MODEL_FILE), dict(self.model.state_dict()))
        save_state(os.path.join(path, OPTIMIZER_FILE), self.optimizer.state_dict())
        with open(os.path.join(path, STATE_FILE), "w", encoding="utf-8") as f:
            json.dump({"format": FORMAT, "optimizer_steps": self.optimizer_steps}, f)

    def load(self, path: str) -> None:
        """Restore exactly what ``save`` wrote; ``FileNotFoundError`` if ``path`` holds no critic."""
        from skyrl_core.state_file import load_state

        if not os.path.isfile(os.path.join(path, STATE_FILE)):
            raise FileNotFoundError(f"{path!r} holds no critic (no {STATE_FILE}): this checkpoint was "
                                    "written by a run without algorithm.critic.enabled")
        with open(os.path.join(path, STATE_FILE), encoding="utf-8") as f:
            state = json.load(f)
        if state.get("format") != FORMAT:
            raise ValueError(f"{path}: critic format {state.get('format')!r}, this trainer reads {FORMAT}")
        self.model.load_state_dict(load_state(os.path.join(path, MODEL_FILE)), strict=True)
        self.optimizer.load_state_dict(load_state(os.path.join(path, OPTIMIZER_FILE)))
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps = int(state["optimizer_steps"])


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over the trained tokens: 0 for values that know nothing (constant),
    1 for exact ones. Read on the values the step started from, so it measures the critic on rows it
    had not trained on yet, whatever the returns' scale (which moves as the policy learns)."""
    trained = mask > 0
    r, v = returns[trained].double(), values[trained].double()
    if r.numel() == 0:
        return 0.0
    spread = float(r.var(unbiased=False))
    # returns that are equal but for float32 rounding (gae's returns are A + V) leave a variance
    # residue near 1e-16: dividing by it gave -1e14. Below rounding level nothing is explained.
    rounding = (1e-6 * max(float(r.abs().max()), 1e-6)) ** 2
    return 1.0 - float((r - v).var(unbiased=False)) / spread if spread > rounding else 0.0


def check_critic_choice(estimator: Any, cfg: Config, resume_from: str | None = None) -> None:
    """Refuse, before any work, an estimator that needs values without a critic, a critic that no
    estimator would read, and a checkpoint to resume (``resume_from``) that holds no critic."""
    try:
        estimator(torch.zeros(1, 1), torch.ones(1, 1), ["g"])
        needs_values = False
    except ValueError as exc:
        needs_values, reason = True, str(exc)
    name = cfg.algorithm.advantage.name
    if needs_values and not cfg.algorithm.critic.enabled:
        raise ValueError(f"algorithm.advantage {name!r} needs a critic: set algorithm.critic.enabled=true "
                         f"({reason})")
    if cfg.algorithm.critic.enabled and not needs_values:
        raise ValueError(f"algorithm.critic.enabled=true, but algorithm.advantage {name!r} reads no values: "
                         "a critic is trained only for an estimator that uses it (gae)")
    path = cfg.algorithm.critic.path
    if path is not None and not cfg.algorithm.critic.enabled:
        raise ValueError(f"algorithm.critic.path={path!r} is set but algorithm.critic.enabled is false")
    if path is not None and not os.path.isfile(os.path.join(os.path.expanduser(path), "config.json")):
        raise ValueError(f"algorithm.critic.path={path!r} is not a Hugging Face model directory (no config.json)")
    if cfg.algorithm.critic.enabled and resume_from is not None:
        from skyrl_core.trainer.checkpoint import CRITIC_DIR

        if not os.path.isfile(os.path.join(resume_from, CRITIC_DIR, STATE_FILE)):
            raise ValueError(f"trainer.resume: checkpoint {resume_from!r} holds no critic ({CRITIC_DIR}/{STATE_FILE}), "
                             "but algorithm.critic.enabled is true: it was written by a run without a critic")
