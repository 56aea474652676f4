"""skyrl's requests and samples <-> SGLang's ``Engine.generate`` inputs and outputs.

SGLang takes one flat batch of prompts, so each request's ``n`` samples are sent as ``n`` entries
with ``n=1``. A request seed ``s`` gives sample ``j`` the seed ``derive_seed(s, j)``, so a sample
depends only on its own request, never on what else is in the batch.
"""

from __future__ import annotations

from typing import Any, Sequence

from skyrl_core.types import GeneratedSample, GenerationRequest, SamplingParams

# SGLang's "no top-k filter" (its SamplingParams also accepts -1 and maps it to this).
TOP_K_OFF = -1


def derive_seed(seed: int, sample_index: int) -> int:
    """A 31-bit seed for sample ``sample_index`` of a request seeded with ``seed``."""
    return (seed * 1_000_003 + sample_index * 7_919 + 1) % (2**31 - 1)


def sglang_sampling_params(sampling: SamplingParams, sample_index: int) -> dict[str, Any]:
    """SGLang's sampling-params dict for one sample (``n`` is always 1 here)."""
    params: dict[str, Any] = {
        "max_new_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else TOP_K_OFF,
        "n": 1,
        "skip_special_tokens": True,
    }
    if sampling.stop:
        params["stop"] = list(sampling.stop)
    if sampling.stop_token_ids:
        params["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.seed is not None:
        params["sampling_seed"] = derive_seed(sampling.seed, sample_index)
    return params


def flatten(requests: Sequence[GenerationRequest]) -> tuple[list[list[int]], list[dict[str, Any]], list[tuple[int, int]]]:
    """``(input_ids, sampling_params, owners)``: one entry per sample; ``owners[k] = (request_pos, sample_index)``."""
    input_ids, params, owners = [], [], []
    for pos, request in enumerate(requests):
        for j in range(request.sampling.n):
            input_ids.append(list(request.prompt_token_ids))
            params.append(sglang_sampling_params(request.sampling, j))
            owners.append((pos, j))
    return input_ids, params, owners


def stop_reason(finish_reason: Any, request_id: str) -> str:
    """SGLang's ``meta_info["finish_reason"]`` (``{"type": "stop"|"length"|"abort", ...}``) as skyrl's."""
    kind = finish_reason.get("type") if isinstance(finish_reason, dict) else finish_reason
    if kind in ("stop", "length"):
        return kind
    raise RuntimeError(f"request {request_id!r} did not finish normally (SGLang finish_reason={finish_reason!r})")


def to_sample(request: GenerationRequest, sample_index: int, output: dict[str, Any]) -> GeneratedSample:
    """One ``GeneratedSample`` from one SGLang output dict (``return_logprob=True``)."""
    meta = output["meta_info"]
    # output_token_logprobs: one (logprob, token_id, token_text_or_None) per generated token.
    pairs = meta.get("output_token_logprobs") or []
    token_ids = [int(t) for t in output.get("output_ids", [tid for _, tid, *_ in pairs])]
    if len(pairs) != len(token_ids) or any(int(tid) != t for (_, tid, *_), t in zip(pairs, token_ids)):
        raise RuntimeError(
            f"request {request.request_id!r}: SGLang's logprobs ({len(pairs)}) do not match its "
            f"{len(token_ids)} output tokens"
        )
    return GeneratedSample(
        request_id=request.request_id,
        sample_index=sample_index,
        prompt_token_ids=request.prompt_token_ids,
        token_ids=token_ids,
        logprobs=[float(lp) for lp, *_ in pairs],
        text=output.get("text") or "",
        stop_reason=stop_reason(meta.get("finish_reason"), request.request_id),
    )


def gather(
    requests: Sequence[GenerationRequest], owners: list[tuple[int, int]], outputs: Sequence[dict[str, Any]]
) -> list[list[GeneratedSample]]:
    """Regroup flat outputs into one list of ``n`` samples per request, in request order."""
    if len(outputs) != len(owners):
        raise RuntimeError(f"SGLang returned {len(outputs)} outputs for {len(owners)} samples")
    grouped: list[list[GeneratedSample]] = [[] for _ in requests]
    for (pos, j), output in zip(owners, outputs):
        grouped[pos].append(to_sample(requests[pos], j, output))
    return grouped
