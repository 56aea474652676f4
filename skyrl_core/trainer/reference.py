"""The frozen reference policy that KL regularisation measures against: the initial weights."""

from __future__ import annotations

import attrs
import torch

from skyrl_core.backends.packing import plan_micro_batches, scatter_rows, trim
from skyrl_core.backends.rank_setup import use_memory_efficient_attention
from skyrl_core.config.schema import ModelConfig, TrainerConfig
from skyrl_core.models import load_causal_lm
from skyrl_core.ops import prepare_model, site_scope
from skyrl_core.ops.chunked_logprobs import response_logprobs
from skyrl_core.types import TrainingBatch


class ReferencePolicy:
    """Scores response tokens with the initial model (fp32, in this process, no gradient), in the
    trainer's micro-batches (``micro_batch_size`` rows, ``micro_batch_tokens`` padded positions)
    with logits ``logprob_chunk_tokens`` positions at a time."""

    def __init__(self, model: ModelConfig, *, seed: int, trainer: TrainerConfig) -> None:
        self.model = load_causal_lm(attrs.evolve(model, dtype="float32"), seed=seed)
        self.model.requires_grad_(False)
        use_memory_efficient_attention(self.model)
        self.ledger = prepare_model(self.model, "trainer")
        self.trainer = trainer

    @torch.no_grad()
    def forward(self, batch: TrainingBatch) -> torch.Tensor:
        """Logprobs ``[B, R]`` of the response tokens, 0 on padding."""
        tc = self.trainer
        parts = []
        with site_scope("trainer_score"):
            for rows in plan_micro_batches(batch, max_rows=tc.micro_batch_size, max_tokens=tc.micro_batch_tokens):
                micro = trim(batch.select(rows))
                real = micro.attention_mask[:, -micro.response_len:].bool()
                logprobs, _ = response_logprobs(self.model, micro.input_ids, micro.attention_mask, micro.response_len,
                                                real, ledger=self.ledger, chunk_tokens=tc.logprob_chunk_tokens)
                parts.append((rows, logprobs))
        return scatter_rows(parts, len(batch), batch.response_len)
