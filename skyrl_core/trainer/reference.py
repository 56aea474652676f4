"""The frozen reference policy that KL regularisation measures against: the initial weights."""

from __future__ import annotations

import attrs
import torch

from skyrl_core.config.schema import ModelConfig
from skyrl_core.models import load_causal_lm
from skyrl_core.ops import prepare_model, site_scope, token_logprobs
from skyrl_core.types import TrainingBatch


class ReferencePolicy:
    """Scores response tokens with the initial model (fp32, in this process, no gradient)."""

    def __init__(self, model: ModelConfig, *, seed: int, micro_batch_size: int) -> None:
        self.model = load_causal_lm(attrs.evolve(model, dtype="float32"), seed=seed)
        self.model.requires_grad_(False)
        self.ledger = prepare_model(self.model, "trainer")
        self.micro_batch_size = micro_batch_size

    @torch.no_grad()
    def forward(self, batch: TrainingBatch) -> torch.Tensor:
        """Logprobs ``[B, R]`` of the response tokens, 0 on padding."""
        out = []
        with site_scope("trainer_score"):
            for micro in batch.split(self.micro_batch_size):
                R = micro.response_len
                mask = micro.attention_mask
                positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
                logits = self.model(input_ids=micro.input_ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
                logprobs = token_logprobs(logits[:, -(R + 1):-1], micro.input_ids[:, -R:], ledger=self.ledger)
                out.append(torch.where(mask[:, -R:].bool(), logprobs.float(), torch.zeros((), dtype=torch.float32)))
        return torch.cat(out)
