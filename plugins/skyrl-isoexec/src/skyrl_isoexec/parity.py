"""Model-level parity helpers: preset models prepared for a role, the ways of computing a sequence's
token logprobs (full forward over a padded batch, KV-cache decode, chunked prefill), bit comparisons.

Used by the tests and the benchmark; importing it imports torch.
"""

from __future__ import annotations

import torch

FAMILIES = ("qwen3", "llama", "qwen3-moe", "qwen3-next")
DTYPES = ("float32", "bfloat16")
# bf16 rounding hides the stock mismatch of the narrowest presets; a wider model shows it.
WIDE_BF16 = {"hidden_size": 512, "intermediate_size": 2048, "moe_intermediate_size": 2048, "shared_expert_intermediate_size": 2048}


def build_model(family: str, dtype: str, *, enabled: bool, role: str = "trainer", wide: bool = False, seed: int = 0):
    """A preset model prepared for ``role`` with IsoExec on or off; returns ``(model, ledger)``."""
    from skyrl_core.config.schema import ModelConfig
    from skyrl_core.models import load_causal_lm
    from skyrl_core.ops import prepare_model
    from skyrl_isoexec import state
    from skyrl_isoexec.presets import preset

    config = preset(family)
    if wide:
        config.update({k: v for k, v in WIDE_BF16.items() if k in config or k in ("hidden_size", "intermediate_size")})
    model = load_causal_lm(ModelConfig(config=config, dtype=dtype), seed=seed)
    with state.enabled_scope(enabled):
        ledger = prepare_model(model, role)
    return model, ledger


def random_sequences(lengths, vocab=512, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def full_logprobs(model, ledger, sequences, site="trainer_score"):
    """One forward over the left-padded batch; per sequence, logprobs of tokens 1.. ([len-1])."""
    from skyrl_core.ops import site_scope, token_logprobs

    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(sequences):
        ids[i, width - len(s) :] = torch.tensor(s)
        mask[i, width - len(s) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    grad = site == "trainer_forward"
    with torch.set_grad_enabled(grad), site_scope(site):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        logprobs = token_logprobs(logits[:, :-1], ids[:, 1:], ledger=ledger)
    return [logprobs[i, width - len(s) :].detach() for i, s in enumerate(sequences)]


def decode_logprobs(model, ledger, sequence, prefill=1, site="engine_decode"):
    """Prefill ``prefill`` tokens (site engine_prefill), then one token per forward against the cache."""
    from transformers.cache_utils import DynamicCache

    from skyrl_core.ops import site_scope, token_logprobs

    cache = DynamicCache(config=model.config)
    out = []
    with torch.no_grad():
        with site_scope("engine_prefill" if site.startswith("engine") else site):
            ids = torch.tensor([sequence[:prefill]])
            logits = model(input_ids=ids, position_ids=torch.arange(prefill)[None], past_key_values=cache, use_cache=True).logits
            out.append(token_logprobs(logits[0, :-1], ids[0, 1:], ledger=ledger))
            out.append(token_logprobs(logits[0, -1:], torch.tensor([sequence[prefill]]), ledger=ledger))
        with site_scope(site):
            for t in range(prefill, len(sequence) - 1):
                logits = model(input_ids=torch.tensor([[sequence[t]]]), position_ids=torch.tensor([[t]]),
                               past_key_values=cache, use_cache=True).logits
                out.append(token_logprobs(logits[0, -1:], torch.tensor([sequence[t + 1]]), ledger=ledger))
    return torch.cat(out)


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def differing(a_list, b_list) -> int:
    """Number of elements whose bit patterns differ, over paired tensors."""
    return sum(int((bits(a) != bits(b)).sum()) for a, b in zip(a_list, b_list, strict=True))
