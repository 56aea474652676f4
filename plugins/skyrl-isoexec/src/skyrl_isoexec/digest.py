"""Per-op, per-token digests of a forward, and the first op where two traces diverge.

A trace runs one sequence through a tiny preset model, either as one full forward
(``trainer_score``) or token by token against a KV cache (``engine_decode``), and records for every
op a patched module computes the hash of each token's output row, keyed by the token's position.
Digests are therefore independent of row order and batch layout: a full-forward trace and a
decode trace of the same tokens are comparable op by op, and ``first_divergence`` names the first
op (in model order) whose output differs at some position.
"""

from __future__ import annotations

import hashlib
from typing import Any


def _row_hashes(out: Any, rows: int) -> list[str]:
    import torch

    parts = out if isinstance(out, (tuple, list)) else (out,)
    flat = []
    for part in parts:
        t = part.detach().contiguous()
        t = t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32) if t.element_size() == 4 else t
        flat.append(t.reshape(rows, -1).cpu().numpy())
    return [
        hashlib.blake2b(b"".join(f[i].tobytes() for f in flat), digest_size=8).hexdigest() for i in range(rows)
    ]


class Recorder:
    """Collects ``{key: {position: row_hash}}``; ``key`` is ``"<n>:<op>:<module>"`` where ``n`` counts
    that (op, module)'s calls within one forward."""

    def __init__(self) -> None:
        self.records: dict[str, dict[int, str]] = {}
        self.order: list[str] = []
        self.positions: list[int] = []
        self._seen: dict[tuple[str, str], int] = {}

    def start_forward(self, positions: list[Any]) -> None:
        """The token identity of each row of the coming forward (None: a padding row)."""
        self.positions = positions
        self._seen = {}

    def __call__(self, op: str, module: str, out: Any) -> None:
        n = self._seen.get((op, module), 0)
        self._seen[(op, module)] = n + 1
        key = f"{n}:{op}:{module}"
        first = out[0] if isinstance(out, (tuple, list)) else out
        rows = len(self.positions)
        if first.numel() % rows:
            return  # not token-major (e.g. per-expert tensors): not comparable by position
        if key not in self.records:
            self.records[key] = {}
            self.order.append(key)
        for position, digest in zip(self.positions, _row_hashes(out, rows)):
            if position is not None:
                self.records[key][position] = digest


def trace(*, preset: str, dtype: str, seed: int, tokens: int, mode: str, off: bool) -> dict[str, Any]:
    """Trace one random sequence of ``tokens`` tokens through preset ``preset`` (see module doc)."""
    import torch

    from skyrl_core.config.schema import ModelConfig
    from skyrl_core.models import load_causal_lm
    from skyrl_core.ops import prepare_model, site_scope, token_logprobs
    from skyrl_core.ops.hf import patch_hf_model
    from skyrl_isoexec import state
    from skyrl_isoexec.presets import preset as preset_config

    if mode not in ("full", "decode"):
        raise ValueError(f"mode must be 'full' or 'decode', got {mode!r}")
    model = load_causal_lm(ModelConfig(config=preset_config(preset), dtype=dtype), seed=seed)
    role, site = ("trainer", "trainer_score") if mode == "full" else ("engine", "engine_decode")
    with state.enabled_scope(not off):
        ledger = prepare_model(model, role)
    patch_hf_model(model, ledger)  # stock runs are traced too: patched modules emit either way
    recorder = Recorder()
    model._skyrl_dispatch.tap = recorder
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=generator)
    logprob_rows: dict[int, str] = {}
    with torch.no_grad(), site_scope(site):
        if mode == "full":
            recorder.start_forward(list(range(tokens)))
            logits = model(input_ids=ids, position_ids=torch.arange(tokens)[None]).logits
            logprobs = token_logprobs(logits[0, :-1], ids[0, 1:], ledger=ledger)
            logprob_rows = dict(enumerate(_row_hashes(logprobs[:, None], tokens - 1)))
        else:
            from transformers.cache_utils import DynamicCache

            cache = DynamicCache(config=model.config)
            for t in range(tokens):
                recorder.start_forward([t])
                logits = model(input_ids=ids[:, t : t + 1], position_ids=torch.tensor([[t]]), past_key_values=cache,
                               use_cache=True).logits
                if t + 1 < tokens:
                    lp = token_logprobs(logits[0, -1:], ids[0, t + 1 : t + 2], ledger=ledger)
                    logprob_rows[t] = _row_hashes(lp[:, None], 1)[0]
    records = {key: {str(p): h for p, h in sorted(recorder.records[key].items())} for key in recorder.order}
    records["0:logprobs:"] = {str(p): h for p, h in sorted(logprob_rows.items())}
    order = recorder.order + ["0:logprobs:"]
    flat = sorted(f"{k}|{p}|{h}" for k, rows in records.items() for p, h in rows.items())
    return {
        "preset": preset, "dtype": dtype, "seed": seed, "mode": mode, "isoexec": not off,
        "order": order, "records": records,
        "digest": hashlib.sha256("\n".join(flat).encode()).hexdigest(),
    }


def first_divergence(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """The first op, in ``a``'s model order, whose row digests differ from ``b``'s at a common
    position; None when every common (op, position) agrees."""
    for key in a["order"]:
        rows_a, rows_b = a["records"].get(key, {}), b["records"].get(key)
        if rows_b is None:
            continue
        differ = sorted(int(p) for p in rows_a if p in rows_b and rows_a[p] != rows_b[p])
        if differ:
            n, op, module = key.split(":", 2)
            common = sum(p in rows_b for p in rows_a)
            return (
                f"first divergence: op {op} in module {module or '(model)'} (call {int(n) + 1} in a forward), "
                f"{len(differ)} of {common} positions differ (first at position {differ[0]})"
            )
    return None
