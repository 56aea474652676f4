"""``skyrl isoexec verify``: generate with one or more engines, score the same tokens in the trainer,
compare bits.

The trainer is built once (for Megatron at tensor or expert parallel 2, its Ray ranks: the costly
part); each engine in turn generates over mixed prompt lengths and batch compositions, and the
trainer (the skyrl-fsdp backend, or skyrl-megatron at tensor and expert parallel 1 or more) scores
every sample under several batch compositions (all at once, reversed, one at a time), so each token
is scored with other paddings, neighbours and micro-batchings than it was generated with. Logprobs
are compared on their fp32 bit patterns, per engine.
"""

from __future__ import annotations

import functools
import random
from typing import Any, Callable, Iterable, Mapping, Sequence

import attrs

from skyrl_isoexec import state


@attrs.frozen
class Comparison:
    """One scoring composition against the engine's logprobs."""

    name: str
    tokens: int
    differing: int
    max_abs_diff: float


@attrs.frozen
class VerifyReport:
    engine: str
    enabled: bool
    trainer_hash: str
    engine_hash: str
    contract_problems: tuple[str, ...]
    comparisons: tuple[Comparison, ...]

    @property
    def tokens(self) -> int:
        return sum(c.tokens for c in self.comparisons)

    @property
    def differing(self) -> int:
        return sum(c.differing for c in self.comparisons)

    @property
    def max_abs_diff(self) -> float:
        return max((c.max_abs_diff for c in self.comparisons), default=0.0)


def build_runtime(kind: str, name: str, options: Any, model: Any, **kwargs: Any) -> Any:
    """Build a registered engine or backend as the trainer does (``skyrl_core.plugins.building.build_selected``:
    ``factory(model, options, **kwargs)``); ``options`` is a mapping, structured there as a config's
    would be, or the options object ``preflight`` already structured."""
    from skyrl_core.config.schema import Selection
    from skyrl_core.plugins.building import build_selected
    from skyrl_core.plugins.manager import get_plugin_manager

    return build_selected(get_plugin_manager(), kind, Selection(name=name, options=options), model, **kwargs)


TRAINER_BACKENDS = ("fsdp", "megatron")


def trainer_options(
    backend: str, *, dtype: str, world_size: int = 1, tensor_parallel: int = 1, expert_parallel: int = 1
) -> dict[str, Any]:
    """The options of the trainer backend ``backend`` on CPU: ``world_size`` processes (FSDP) or
    ``world_size`` data-parallel replicas of ``tensor_parallel`` processes each (Megatron; at least
    ``expert_parallel`` replicas, over which the experts are split)."""
    precision = "bf16" if dtype == "bfloat16" else "fp32"
    if backend == "fsdp":
        if tensor_parallel != 1:
            raise ValueError(f"tensor parallel {tensor_parallel} needs --backend megatron (skyrl-fsdp shards, it does not split layers)")
        if expert_parallel != 1:
            raise ValueError(f"expert parallel {expert_parallel} needs --backend megatron (skyrl-fsdp does not split experts)")
        return {"world_size": world_size, "device": "cpu", "mixed_precision": precision}
    if backend == "megatron":
        return {
            "tensor_parallel": tensor_parallel, "world_size": tensor_parallel * max(world_size, expert_parallel),
            "expert_parallel": expert_parallel, "device": "cpu",
            "mixed_precision": precision,
        }
    raise ValueError(f"verify builds the trainer from one of {', '.join(TRAINER_BACKENDS)}; got {backend!r}")


def model_config(*, preset: str | None, model_dir: str | None, dtype: str) -> Any:
    from skyrl_core.config.schema import ModelConfig
    from skyrl_isoexec.presets import preset as preset_config

    if (preset is None) == (model_dir is None):
        raise ValueError("give exactly one of --preset and --model")
    if preset is not None:
        return ModelConfig(config=preset_config(preset), dtype=dtype)
    return ModelConfig(path=model_dir, dtype=dtype)


def make_requests(rng: random.Random, vocab: int, batch: int) -> list[Any]:
    """A batch of 1..5 requests with prompts of 2..24 tokens, 1 or 2 samples, 3..12 new tokens."""
    from skyrl_core.types import GenerationRequest, SamplingParams

    requests = []
    for i in range(rng.randint(1, 5)):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 24))]
        sampling = SamplingParams(
            max_tokens=rng.randint(3, 12), temperature=1.0, n=rng.choice([1, 2]), seed=rng.randrange(1 << 31)
        )
        requests.append(GenerationRequest(request_id=f"b{batch}r{i}", prompt_token_ids=prompt, sampling=sampling))
    return requests


def training_batch(samples: list[Any]) -> Any:
    """Left-padded prompts, right-padded responses (``skyrl_core.types.TrainingBatch`` layout)."""
    import torch

    from skyrl_core.types import TrainingBatch

    P = max(len(s.prompt_token_ids) for s in samples)
    R = max(len(s.token_ids) for s in samples)
    ids = torch.zeros(len(samples), P + R, dtype=torch.long)
    mask = torch.zeros_like(ids)
    loss = torch.zeros(len(samples), R)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_token_ids), len(s.token_ids)
        ids[i, P - p : P] = torch.tensor(s.prompt_token_ids)
        ids[i, P : P + r] = torch.tensor(s.token_ids)
        mask[i, P - p : P + r] = 1
        loss[i, :r] = 1.0
    return TrainingBatch(input_ids=ids, attention_mask=mask, loss_mask=loss)


def compare_logprobs(name: str, samples: list[Any], scored: Any) -> Comparison:
    """Bitwise comparison of the engine's logprobs with the trainer's ``[B, R]`` scores."""
    import torch

    tokens = differing = 0
    worst = 0.0
    for i, s in enumerate(samples):
        engine = torch.tensor(s.logprobs, dtype=torch.float32)
        trainer = scored[i, : len(s.token_ids)].float().contiguous()
        tokens += engine.numel()
        differing += int((engine.view(torch.int32) != trainer.view(torch.int32)).sum())
        if engine.numel():
            worst = max(worst, float((engine.double() - trainer.double()).abs().max()))
    return Comparison(name=name, tokens=tokens, differing=differing, max_abs_diff=worst)


def verify(*, engine: str = "torch", engine_options: dict[str, Any] | None = None, **kwargs: Any) -> VerifyReport:
    """``verify_engines`` with one engine: its report."""
    return verify_engines(engines=(engine,), engine_options={engine: dict(engine_options or {})}, **kwargs)[engine]


def check_engines(engines: Sequence[str], engine_options: Mapping[str, Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Each engine's options as given: an empty or repeated engine list, or options for an engine not
    asked for, is refused here (the options themselves are checked by ``preflight``)."""
    if isinstance(engines, str) or not engines:
        raise ValueError(f"engines: give a non-empty sequence of engine names, got {engines!r}")
    repeated = sorted({e for e in engines if list(engines).count(e) > 1})
    if repeated:
        raise ValueError(f"engines: {', '.join(repeated)} given more than once in {list(engines)}")
    options = {name: dict(opts) for name, opts in (engine_options or {}).items()}
    stray = sorted(set(options) - set(engines))
    if stray:
        raise ValueError(f"engine options for {', '.join(stray)}, which is not among the engines {list(engines)}")
    return {name: options.get(name, {}) for name in engines}


def preflight(model: Any, components: Sequence[tuple[str, str, dict[str, Any]]]) -> list[tuple[str, str, Any]]:
    """Each ``(kind, name, options)`` resolved (an unknown name or a bad option is an error naming its
    key path) and its registered pre-flight check run against ``model``, as ``skyrl train`` runs them;
    every problem is raised together as one ``ValueError`` before anything is built. Returns
    ``(kind, name, structured options)`` for ``build_runtime``."""
    from skyrl_core.config.loader import structure_options
    from skyrl_core.config.schema import Config
    from skyrl_core.plugins.manager import get_plugin_manager

    resolved = []
    for kind, name, options in components:
        spec = get_plugin_manager().spec(kind, name)
        resolved.append((kind, name, structure_options(spec, dict(options), path=f"{kind}:{name}")))
    config = Config(model=model)
    problems = [
        f"{kind}:{name}: {problem}"
        for kind, name, structured in resolved
        for problem in get_plugin_manager().spec(kind, name).preflight_problems(config, structured)
    ]
    if problems:
        raise ValueError("; ".join(problems))
    return resolved


@attrs.frozen
class VerifyPlan:
    """One model and dtype's verification, checked and ready to build: the trainer's and each
    engine's structured options (``plan_verify``)."""

    model: Any
    backend: str
    trainer_options: Any
    engine_options: tuple[tuple[str, Any], ...]  # (engine name, structured options), in order


def plan_verify(
    *,
    engines: Sequence[str] = ("torch",),
    preset: str | None = None,
    model_dir: str | None = None,
    dtype: str = "float32",
    world_size: int = 1,
    backend: str = "fsdp",
    tensor_parallel: int = 1,
    expert_parallel: int = 1,
    engine_options: Mapping[str, Mapping[str, Any]] | None = None,
) -> VerifyPlan:
    """Everything ``verify_engines`` checks before it builds: unknown engines or backends, bad options
    and pairs the components' own checks refuse (bf16 Megatron on CPU, expert parallelism for a dense
    model, ...) raise here, so that several plans can all be checked before any is run."""
    model = model_config(preset=preset, model_dir=model_dir, dtype=dtype)
    options = trainer_options(
        backend, dtype=dtype, world_size=world_size, tensor_parallel=tensor_parallel, expert_parallel=expert_parallel
    )
    per_engine = check_engines(engines, engine_options)
    (_, _, trainer_structured), *engine_structured = preflight(
        model, [("training_backend", backend, options), *(("inference_engine", n, o) for n, o in per_engine.items())]
    )
    return VerifyPlan(model=model, backend=backend, trainer_options=trainer_structured,
                      engine_options=tuple((name, structured) for _, name, structured in engine_structured))


def run_verify(plan: VerifyPlan, *, seed: int = 0, batches: int = 3, off: bool = False,
               echo: Callable[[str], None] = print) -> dict[str, VerifyReport]:
    """Build the plan's trainer once; then, for each of its engines in turn, generate ``batches``
    batches with it (the same prompts and seeds for every engine), score them in that one trainer
    and compare bits. Returns each engine's report, in the plan's order."""
    from skyrl_core.config.schema import TrainerConfig

    reports = {}
    with state.enabled_scope(not off):
        trainer = build_runtime("training_backend", plan.backend, plan.trainer_options, plan.model, seed=seed,
                                trainer=TrainerConfig(micro_batch_size=3))
        try:
            for name, structured in plan.engine_options:
                say = functools.partial(echo_prefixed, echo, f"engine {name}: ") if len(plan.engine_options) > 1 else echo
                reports[name] = _verify_engine(trainer, name, structured, plan.model, seed=seed, batches=batches, echo=say)
        finally:
            trainer.close()
    if len(reports) > 1:
        echo(total_line(reports.values(), f"engines {', '.join(reports)}"))
    return reports


def total_line(reports: Iterable[VerifyReport], what: str) -> str:
    """The summary over several reports: ``N differing tokens of M; max |dlogp| = X (WHAT)``."""
    reports = list(reports)
    return (f"{sum(r.differing for r in reports)} differing tokens of {sum(r.tokens for r in reports)};"
            f" max |dlogp| = {max(r.max_abs_diff for r in reports):.3e} ({what})")


def verify_engines(
    *,
    seed: int = 0,
    batches: int = 3,
    off: bool = False,
    echo: Callable[[str], None] = print,
    **plan: Any,
) -> dict[str, VerifyReport]:
    """``plan_verify(**plan)`` (engines, preset or model_dir, dtype, backend and its layout, engine
    options: ``engine_options`` maps an engine's name to its options as under ``engine.options`` in
    a config), then ``run_verify``: the trainer built once, each engine compared against it."""
    return run_verify(plan_verify(**plan), seed=seed, batches=batches, off=off, echo=echo)


def echo_prefixed(echo: Callable[[str], None], prefix: str, line: str) -> None:
    """``echo(prefix + line)``: one engine's or one case's lines among several."""
    echo(prefix + line)


def _verify_engine(trainer: Any, name: str, options: Any, model: Any, *, seed: int, batches: int,
                   echo: Callable[[str], None]) -> VerifyReport:
    """One engine against the built ``trainer``: contracts, weight sync, generation, three scorings."""
    import torch

    from skyrl_isoexec.contract import build_contract, compare

    generator = build_runtime("inference_engine", name, options, model, seed=seed)
    enabled = state.enabled()

    def contracts() -> dict[str, Any]:
        return {
            role: build_contract(role, runtime.execution_contract().get("ledger"), enabled=enabled)
            for role, runtime in (("trainer", trainer), ("engine", generator))
        }

    try:
        before = contracts()
        problems = compare(before["trainer"], before["engine"])
        echo(f"isoexec {'on' if enabled else 'off'}; contract hashes: trainer {before['trainer']['hash'][:16]}"
             f" engine {before['engine']['hash'][:16]}")
        for problem in problems:
            echo(f"  contract: {problem}")
        generator.update_weights(trainer.export_weights())

        rng = random.Random(seed)
        vocab = int(generator.vocab_size) if hasattr(generator, "vocab_size") else 512
        samples = []
        for b in range(batches):
            groups = generator.generate(make_requests(rng, vocab, b))
            samples.extend(s for group in groups for s in group)
        results = []
        for composition, order in {
            "all at once": list(range(len(samples))),
            "reversed": list(reversed(range(len(samples)))),
            "one at a time": None,
        }.items():
            if order is None:
                parts = [trainer.forward(training_batch([s])) for s in samples]
                width = max(p.shape[1] for p in parts)
                scored = torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])
                results.append(compare_logprobs(composition, samples, scored))
            else:
                ordered = [samples[i] for i in order]
                results.append(compare_logprobs(composition, ordered, trainer.forward(training_batch(ordered))))
        # After scoring (ops have run): the fingerprints of both sides.
        after = contracts()
        problems = compare(after["trainer"], after["engine"])
        for problem in problems:
            echo(f"  contract after scoring: {problem}")
    finally:
        generator.close()
    report = VerifyReport(
        engine=name, enabled=enabled, trainer_hash=after["trainer"]["hash"], engine_hash=after["engine"]["hash"],
        contract_problems=tuple(problems), comparisons=tuple(results),
    )
    for c in report.comparisons:
        echo(f"  trainer scoring '{c.name}': {c.differing} of {c.tokens} tokens differ, max |dlogp| = {c.max_abs_diff:.3e}")
    echo(f"{report.differing} differing tokens of {report.tokens}; max |dlogp| = {report.max_abs_diff:.3e}")
    return report
