"""``skyrl isoexec verify``: generate with an engine, score the same tokens in the trainer, compare bits.

The engine generates over mixed prompt lengths and batch compositions; the trainer (the skyrl-fsdp
backend, or skyrl-megatron at tensor parallel 1 or more) then scores every sample under several
batch compositions (all at once, reversed, one at a time), so each token is scored with other
paddings, neighbours and micro-batchings than it was generated with. Logprobs are compared on their
fp32 bit patterns.
"""

from __future__ import annotations

import random
from typing import Any, Callable

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


def build_runtime(kind: str, name: str, options: dict[str, Any], model: Any, **kwargs: Any) -> Any:
    """Build a registered engine or backend as the trainer does: ``factory(model, options, **kwargs)``."""
    from skyrl_core.config.loader import structure_options
    from skyrl_core.plugins.manager import get_plugin_manager

    spec = get_plugin_manager().spec(kind, name)
    return spec.load_factory()(model, structure_options(spec, options, path=f"{kind}:{name}"), **kwargs)


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


def verify(
    *,
    preset: str | None = None,
    model_dir: str | None = None,
    engine: str = "torch",
    dtype: str = "float32",
    seed: int = 0,
    batches: int = 3,
    off: bool = False,
    world_size: int = 1,
    backend: str = "fsdp",
    tensor_parallel: int = 1,
    expert_parallel: int = 1,
    engine_options: dict[str, Any] | None = None,
    echo: Callable[[str], None] = print,
) -> VerifyReport:
    """Generate ``batches`` batches with ``engine``, score them in the trainer ``backend`` (``fsdp`` or
    ``megatron``, at ``tensor_parallel`` and ``expert_parallel``), compare bits. ``engine_options`` are the
    engine's options as under ``engine.options`` in a config (validated by the engine's schema)."""
    from skyrl_core.config.schema import TrainerConfig
    from skyrl_isoexec.contract import build_contract, compare

    from skyrl_core.plugins.manager import get_plugin_manager

    model = model_config(preset=preset, model_dir=model_dir, dtype=dtype)
    options = trainer_options(
        backend, dtype=dtype, world_size=world_size, tensor_parallel=tensor_parallel, expert_parallel=expert_parallel
    )
    from skyrl_core.config.loader import structure_options

    # An unknown engine name or a bad engine option fails before anything is built.
    structure_options(get_plugin_manager().spec("inference_engine", engine), dict(engine_options or {}),
                      path=f"inference_engine:{engine}")
    get_plugin_manager().spec("training_backend", backend)
    with state.enabled_scope(not off):
        trainer = build_runtime("training_backend", backend, options, model, seed=seed, trainer=TrainerConfig(micro_batch_size=3))
        generator = build_runtime("inference_engine", engine, dict(engine_options or {}), model, seed=seed)
        try:
            enabled = state.enabled()
            contracts = {
                role: build_contract(role, runtime.execution_contract().get("ledger"), enabled=enabled)
                for role, runtime in (("trainer", trainer), ("engine", generator))
            }
            problems = compare(contracts["trainer"], contracts["engine"])
            echo(f"isoexec {'on' if enabled else 'off'}; contract hashes: trainer {contracts['trainer']['hash'][:16]}"
                 f" engine {contracts['engine']['hash'][:16]}")
            for problem in problems:
                echo(f"  contract: {problem}")
            generator.update_weights(trainer.export_weights())

            rng = random.Random(seed)
            vocab = int(generator.vocab_size) if hasattr(generator, "vocab_size") else 512
            samples = []
            for b in range(batches):
                groups = generator.generate(make_requests(rng, vocab, b))
                samples.extend(s for group in groups for s in group)
            compositions = {
                "all at once": list(range(len(samples))),
                "reversed": list(reversed(range(len(samples)))),
                "one at a time": None,
            }
            results = []
            for name, order in compositions.items():
                if order is None:
                    import torch

                    parts = [trainer.forward(training_batch([s])) for s in samples]
                    width = max(p.shape[1] for p in parts)
                    scored = torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])
                    results.append(compare_logprobs(name, samples, scored))
                else:
                    ordered = [samples[i] for i in order]
                    results.append(compare_logprobs(name, ordered, trainer.forward(training_batch(ordered))))
            # After scoring (ops have run): the fingerprints of both sides.
            contracts = {
                role: build_contract(role, runtime.execution_contract().get("ledger"), enabled=enabled)
                for role, runtime in (("trainer", trainer), ("engine", generator))
            }
            problems = compare(contracts["trainer"], contracts["engine"])
            for problem in problems:
                echo(f"  contract after scoring: {problem}")
        finally:
            generator.close()
            trainer.close()
    report = VerifyReport(
        enabled=enabled,
        trainer_hash=contracts["trainer"]["hash"],
        engine_hash=contracts["engine"]["hash"],
        contract_problems=tuple(problems),
        comparisons=tuple(results),
    )
    for c in report.comparisons:
        echo(f"  trainer scoring '{c.name}': {c.differing} of {c.tokens} tokens differ, max |dlogp| = {c.max_abs_diff:.3e}")
    echo(f"{report.differing} differing tokens of {report.tokens}; max |dlogp| = {report.max_abs_diff:.3e}")
    return report
