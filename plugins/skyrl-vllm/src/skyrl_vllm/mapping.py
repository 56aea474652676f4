"""skyrl's sampling parameters and samples <-> vLLM's, one field to one field."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from skyrl_core.types import GeneratedSample, GenerationRequest, SamplingParams

if TYPE_CHECKING:
    import vllm


def to_vllm_sampling_params(sampling: SamplingParams) -> vllm.SamplingParams:
    """The vLLM ``SamplingParams`` for ``sampling``.

    ``logprobs=0`` asks for the sampled token's own logprob only; with the engine's
    ``logprobs_mode="raw_logprobs"`` it is taken before temperature and top-k/top-p, which is what
    ``GeneratedSample.logprobs`` promises. skyrl's ``top_k=0`` ("off") is vLLM's ``top_k=0`` too.
    vLLM refuses ``n > 1`` with greedy decoding, whose samples are all the same: one is sampled and
    ``to_samples`` repeats it.
    """
    import vllm

    return vllm.SamplingParams(
        n=1 if is_greedy(sampling) else sampling.n,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        seed=sampling.seed,
        stop=list(sampling.stop) or None,
        stop_token_ids=list(sampling.stop_token_ids) or None,
        max_tokens=sampling.max_tokens,
        logprobs=0,
        skip_special_tokens=True,
    )


def is_greedy(sampling: SamplingParams) -> bool:
    """Whether vLLM decodes greedily (its threshold: temperature below 1e-5)."""
    return sampling.temperature < 1e-5


def stop_reason(finish_reason: str | None, request_id: str) -> str:
    """vLLM's ``finish_reason`` as skyrl's ``stop_reason`` ("stop" | "length")."""
    if finish_reason in ("stop", "length"):
        return finish_reason
    raise RuntimeError(f"request {request_id!r} did not finish normally (vLLM finish_reason={finish_reason!r})")


def token_versions(completion: Any, request_id: str) -> tuple[int, ...]:
    """The policy version of each sampled token, from vLLM's per-token spans of weight-version labels
    (``CompletionOutput.weight_versions``; the engine sets each label to a version number)."""
    spans = completion.weight_versions or ()
    versions = tuple(int(span.version) for span in spans for _ in range(span.start, span.end))
    if len(versions) != len(completion.token_ids):
        raise RuntimeError(
            f"request {request_id!r}: vLLM labelled {len(versions)} of {len(completion.token_ids)} tokens with a weight version"
        )
    return versions


def to_samples(request: GenerationRequest, output: Any, *, versioned: bool = False) -> list[GeneratedSample]:
    """The ``n`` samples of one vLLM ``RequestOutput`` (anything with its ``outputs``), in
    sample-index order; ``versioned``: with each token's policy version (``token_versions``)."""
    samples: list[GeneratedSample] = []
    for completion in sorted(output.outputs, key=lambda c: c.index):
        token_ids = tuple(int(t) for t in completion.token_ids)
        if completion.logprobs is None or len(completion.logprobs) != len(token_ids):
            raise RuntimeError(f"request {request.request_id!r}: vLLM returned no logprob for some sampled tokens")
        logprobs = tuple(float(step[tok].logprob) for step, tok in zip(completion.logprobs, token_ids))
        samples.append(
            GeneratedSample(
                request_id=request.request_id,
                sample_index=int(completion.index),
                prompt_token_ids=request.prompt_token_ids,
                token_ids=token_ids,
                logprobs=logprobs,
                text=completion.text,
                stop_reason=stop_reason(completion.finish_reason, request.request_id),
                token_versions=token_versions(completion, request.request_id) if versioned else (),
            )
        )
    if is_greedy(request.sampling) and len(samples) == 1:
        samples += [attrs.evolve(samples[0], sample_index=j) for j in range(1, request.sampling.n)]
    return samples
