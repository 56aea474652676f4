"""Token log-probabilities and entropies over vocabulary-parallel logits.

Megatron's output layer leaves each tensor-parallel rank with a slice of the vocabulary
(``[..., V_padded / tp]``). ``vocab_parallel_logprobs`` computes the fp32 log-softmax across the
slices with two all-reduces (the max is only for stability), never materialising full logits;
padding rows of the vocabulary (global index >= ``vocab_size``) are excluded. Every rank ends with
the same ``[...]`` result, and gradients flow back to each rank's own slice.

``gather_vocab`` is the other route: all-gather the full logits (with gradient) so an op installed
through ``skyrl_core.ops`` (IsoExec's canonical logprob, say) sees exactly the logits it would see
at tensor parallel 1, which makes its result independent of the tensor-parallel degree.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _SumAcrossRanks(torch.autograd.Function):
    """All-reduce (sum) in forward, identity in backward. Exact when every rank goes on to compute
    the same loss from the sum alone (no per-rank partial terms downstream): then each rank's
    gradient of the sum is the whole gradient, which is the gradient of its addend."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:  # noqa: ARG004 - autograd signature
        x = x.clone()
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherVocab(torch.autograd.Function):
    """All-gather vocabulary slices on the last dim; backward keeps this rank's slice of the
    gradient (every rank's gradient of the full logits is the same)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        ctx.rank, ctx.width = dist.get_rank(group), x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start = ctx.rank * ctx.width
        return grad[..., start : start + ctx.width].contiguous(), None


def _shifted_and_exp(logits: torch.Tensor, vocab_start: int, vocab_size: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``x - max`` (max over the whole distributed vocabulary, for stability only) and its
    ``exp``, with the vocabulary's padding entries (global index >= ``vocab_size``) given exp 0.

    Padding is zeroed after ``exp`` rather than set to -inf before it, so no inf or nan can reach
    a gradient."""
    x = logits.float()
    width = x.shape[-1]
    padding = None
    if vocab_start + width > vocab_size:
        padding = torch.arange(vocab_start, vocab_start + width, device=x.device) >= vocab_size
    real = x.detach() if padding is None else x.detach().masked_fill(padding, float("-inf"))
    row_max = real.amax(dim=-1)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    shifted = x - row_max.unsqueeze(-1)
    exp = shifted.exp()
    if padding is not None:
        exp = torch.where(padding, torch.zeros_like(exp), exp)
    return shifted, exp


def vocab_parallel_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, *, vocab_start: int, vocab_size: int, group
) -> torch.Tensor:
    """``log softmax(logits)[targets]`` in fp32, where ``logits`` is this rank's vocabulary slice
    starting at global index ``vocab_start`` (``[..., width]``) and ``targets`` are global ids."""
    shifted, exp = _shifted_and_exp(logits, vocab_start, vocab_size, group)
    sum_exp = _SumAcrossRanks.apply(exp.sum(dim=-1), group)
    local = targets.long() - vocab_start
    mine = (local >= 0) & (local < shifted.shape[-1])
    picked = shifted.gather(-1, local.clamp(0, shifted.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    picked = _SumAcrossRanks.apply(torch.where(mine, picked, torch.zeros_like(picked)), group)
    return picked - sum_exp.log()


def vocab_parallel_entropy(logits: torch.Tensor, *, vocab_start: int, vocab_size: int, group) -> torch.Tensor:
    """Entropy ``-sum p log p`` in fp32 of the distribution whose slice on this rank is ``logits``.

    Written as ``log Z - sum(e^s s) / Z`` so that both sums are all-reduced before any per-rank
    use: then every rank holds the same full quantities, and identity backward is exact."""
    shifted, exp = _shifted_and_exp(logits, vocab_start, vocab_size, group)
    sum_exp = _SumAcrossRanks.apply(exp.sum(dim=-1), group)
    weighted = _SumAcrossRanks.apply((exp * shifted).sum(dim=-1), group)
    return sum_exp.log() - weighted / sum_exp


def gather_vocab(logits: torch.Tensor, group) -> torch.Tensor:
    """The full ``[..., V_padded]`` logits on every rank of ``group`` (differentiable)."""
    if group is None or dist.get_world_size(group) == 1:
        return logits
    return _GatherVocab.apply(logits, group)
