"""Client-side recipes written against the official ``tinker`` SDK only (what a user's script does),
shared by this plugin's tests and ``benchmarks/tinker_rl_step.py``.

``arithmetic_prompts`` is a single-token arithmetic task: the prompt ``"a+b="``, the answer the
last digit of ``a + b`` as one token. Its reward is dense (``1 - |sampled - answer| / width``,
clipped at 0, on the first sampled token) so that a tiny random model, which almost never hits
the exact token, still gets a learning signal within a few steps.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Sequence

import attrs


@attrs.frozen
class Prompt:
    tokens: tuple[int, ...]
    answer: int  # the answer's token id


def arithmetic_prompts(encode: Callable[[str], list[int]], count: int, seed: int = 0) -> list[Prompt]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        prompts.append(Prompt(tuple(encode(f"{a}+{b}=")), encode(str((a + b) % 10))[0]))
    return prompts


def reward(tokens: Sequence[int], answer: int, width: float = 64.0) -> float:
    if not tokens:
        return 0.0
    return max(0.0, 1.0 - abs(int(tokens[0]) - answer) / width)


def rl_step(
    training_client: Any,
    sampling_client: Any,
    prompts: Sequence[Prompt],
    *,
    samples: int,
    max_tokens: int,
    learning_rate: float,
    seed: int,
    loss_fn: str = "importance_sampling",
    timings: dict[str, float] | None = None,
    lengths: list[tuple[int, int]] | None = None,
) -> tuple[float, Any]:
    """One RL step as a Tinker user writes it: sample ``samples`` continuations of every prompt,
    group-centred advantages, one ``forward_backward`` with ``loss_fn`` on the sampler's logprobs,
    one ``optim_step``, then a sampling client for the new weights. Returns the mean reward of
    this step's samples and that sampling client. ``timings`` (if given) receives the seconds of
    each phase: ``sample`` (all samples back), ``train`` (``forward_backward`` and ``optim_step``
    back), ``save`` (the next sampling client ready). ``lengths`` (if given) receives ``(prompt
    tokens, sampled tokens)`` of every sample."""
    import time

    from tinker import types

    start = time.perf_counter()
    params = [types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed * 1000 + i) for i in range(len(prompts))]
    futures = [
        sampling_client.sample(types.ModelInput.from_ints(list(p.tokens)), num_samples=samples, sampling_params=sp)
        for p, sp in zip(prompts, params)
    ]
    data, rewards = [], []
    for prompt, future in zip(prompts, futures):
        sequences = future.result().sequences
        group = [reward(s.tokens, prompt.answer) for s in sequences]
        rewards += group
        mean = sum(group) / len(group)
        P = len(prompt.tokens)
        for seq, r in zip(sequences, group):
            if lengths is not None:
                lengths.append((P, len(seq.tokens)))
            if not seq.tokens:
                continue
            full = list(prompt.tokens) + list(seq.tokens)
            n = len(seq.tokens)
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={
                        "target_tokens": full[1:],
                        "logprobs": [0.0] * (P - 1) + list(seq.logprobs),
                        "advantages": [0.0] * (P - 1) + [r - mean] * n,
                    },
                )
            )
    sampled = time.perf_counter()
    backward = training_client.forward_backward(data, loss_fn)
    step = training_client.optim_step(types.AdamParams(learning_rate=learning_rate))
    backward.result()
    step.result()
    trained = time.perf_counter()
    next_sampler = training_client.save_weights_and_get_sampling_client().result()
    if timings is not None:
        timings.update(sample=sampled - start, train=trained - sampled, save=time.perf_counter() - trained)
    return sum(rewards) / len(rewards), next_sampler
