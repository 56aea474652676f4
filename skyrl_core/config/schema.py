"""The config schema: frozen attrs classes. ``help`` metadata is shown by ``skyrl config show --help``
and in docs/config.md.

Selectable sections (``engine``, ``backend``, ``algorithm.policy_loss``, ...) are ``Selection``:
``{name, options}``. ``name`` is checked against what plugins registered, then ``options`` is
structured with that plugin's own options class (see ``skyrl_core.config.loader``).
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from skyrl_core.config.validators import holds, nested


def _help(text: str, **kw: Any) -> dict[str, Any]:
    return {"help": text, **kw}


def _section(cls: type, text: str, **kw: Any) -> Any:
    """A field holding section ``cls``: given as a mapping in Python it becomes ``cls``, checked
    (``skyrl_core.config.validators.nested``); the loader gives it a ``cls`` already."""
    return attrs.field(converter=nested(cls), validator=holds(cls), metadata=_help(text), **kw)


def _number(value: Any) -> None:
    # (a string, a bool or NaN compares as no bound wants: refused before the comparison)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"must be a number; got {value!r}")


def _positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None:
        _number(value)
        if value <= 0:
            raise ValueError("must be > 0")


def _non_negative(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None:
        _number(value)
        if value < 0:
            raise ValueError("must be >= 0")


def _unit_mass(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None:
        _number(value)
        if not 0 < value <= 1:
            raise ValueError("must be in (0, 1]")


def _one_of(*allowed: Any):
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value not in allowed:
            raise ValueError("not one of the allowed values")

    check.allowed = allowed  # type: ignore[attr-defined]
    return check


@attrs.frozen(kw_only=True)
class Selection:
    """A pluggable component chosen by name, with that component's own options."""

    name: str = attrs.field(metadata=_help("registered name of the component"))
    options: Any = attrs.field(factory=dict, metadata=_help("options of the selected component"))


def _token_resources(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not value or any(not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0
                        for k, v in value.items()):
        raise ValueError("expected a non-empty mapping of Ray resource names to amounts > 0")


@attrs.frozen(kw_only=True)
class EngineConfig(Selection):
    """The inference engine: which one (``name``, ``options``) and where it runs (docs/training.md)."""

    placement: str = attrs.field(
        default="colocated", validator=_one_of("colocated", "separate"),
        metadata=_help("colocated: the engine runs in the trainer's process; separate: each replica is a Ray "
                       "actor process of its own, so generation overlaps training"),
    )
    replicas: int = attrs.field(
        default=1, validator=_positive,
        metadata=_help("engine processes (placement=separate); a router sends each request to the least-loaded "
                       "one and keeps a multi-turn episode on its replica"),
    )
    weight_sync: str = attrs.field(
        default="auto", validator=_one_of("auto", "broadcast", "checkpoint"),
        metadata=_help("how new weights reach separate engines: broadcast (torch.distributed over gloo from the "
                       "trainer), checkpoint (safetensors written to a directory, then loaded); auto: in-process "
                       "tensors when colocated, broadcast when separate"),
    )
    restart_on_failure: bool = attrs.field(
        default=False,
        metadata=_help("placement=separate: a dead engine process is restarted with the current weights and its "
                       "requests retried (false: the run stops with an error naming it)"),
    )
    ray_placement: str = attrs.field(
        default="colocate", validator=_one_of("colocate", "disaggregate"),
        metadata=_help("placement=separate, Ray placement groups: colocate puts trainer ranks and engine replicas "
                       "on one node; disaggregate puts the trainer ranks on one node and the engine replicas on another (the trainer must run Ray rank actors: backend world_size >= 2)"),
    )
    trainer_bundle: dict[str, float] = attrs.field(
        factory=lambda: {"CPU": 0.01}, validator=_token_resources,
        metadata=_help("Ray resources the trainer ranks' bundle reserves (a custom resource pins it to the nodes "
                       "that have it)"),
    )
    engine_bundle: dict[str, float] = attrs.field(
        factory=lambda: {"CPU": 0.01}, validator=_token_resources,
        metadata=_help("Ray resources each engine replica's bundle reserves"),
    )


@attrs.frozen(kw_only=True)
class ModelConfig:
    """Where the policy comes from: a local directory, or a Hugging Face config to build randomly."""

    path: str | None = attrs.field(default=None, metadata=_help("local Hugging Face model directory", path="input"))
    config: dict[str, Any] | None = attrs.field(
        default=None, metadata=_help("a transformers config dict (with model_type) to build a random model")
    )
    tokenizer: str | None = attrs.field(default=None, metadata=_help("tokenizer directory (default: path)", path="input"))
    dtype: str = attrs.field(
        default="float32",
        validator=_one_of("float32", "bfloat16"),
        metadata=_help(
            "compute dtype of the engine and the trainer: bfloat16 samples and trains in bf16 over fp32 master "
            "weights and optimizer state, logprobs and loss in fp32 (docs/training.md, bf16)"
        ),
    )

    def __attrs_post_init__(self) -> None:
        if (self.path is None) == (self.config is None):
            raise ValueError("exactly one of model.path and model.config must be set")


@attrs.frozen(kw_only=True)
class GenerationConfig:
    max_new_tokens: int = attrs.field(default=64, validator=_positive, metadata=_help("tokens per response"))
    temperature: float = attrs.field(default=1.0, validator=_non_negative, metadata=_help("sampling temperature"))
    top_p: float = attrs.field(default=1.0, validator=_unit_mass, metadata=_help("nucleus sampling mass, in (0, 1] (1: off)"))
    top_k: int = attrs.field(default=0, validator=_non_negative, metadata=_help("top-k filter (0: off)"))
    n_samples: int = attrs.field(default=8, validator=_positive, metadata=_help("samples per prompt"))
    stop: tuple[str, ...] = attrs.field(default=(), converter=tuple, metadata=_help("stop strings"))
    eval_temperature: float = attrs.field(default=0.0, validator=_non_negative, metadata=_help("eval temperature"))
    eval_n_samples: int = attrs.field(default=1, validator=_positive, metadata=_help("samples per eval prompt (pass@n)"))


@attrs.frozen(kw_only=True)
class KLConfig:
    estimator: str = attrs.field(default="k3", validator=_one_of("k1", "k2", "k3", "abs"), metadata=_help("KL estimator"))
    use_as: str = attrs.field(
        default="none", validator=_one_of("none", "loss", "reward"), metadata=_help("KL as a loss term, a reward penalty, or off")
    )
    coef: float = attrs.field(default=0.0, validator=_non_negative, metadata=_help("KL coefficient"))
    adaptive_target: float | None = attrs.field(default=None, metadata=_help("target KL for the adaptive controller"))
    adaptive_horizon: int = attrs.field(default=10000, validator=_positive, metadata=_help("adaptive controller horizon"))


def _at_least(low_field: str):
    """Cross-field: this upper bound must be >= the lower bound ``low_field`` (when both are set)."""

    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        low = getattr(instance, low_field)
        if value is not None and low is not None and value < low:
            raise ValueError(f"must be >= {low_field} ({low})")

    return check


@attrs.frozen(kw_only=True)
class OffPolicyConfig:
    """Corrections for a trainer/engine mismatch, for when IsoExec is off (docs/algorithms.md).
    Ratios are ``rho_t = pi_old / pi_rollout`` per trained token."""

    tis: str = attrs.field(default="none", validator=_one_of("none", "token", "sequence"), metadata=_help("truncated IS level"))
    token_tis_cap: float = attrs.field(default=2.0, validator=_positive, metadata=_help("cap of rho_t (tis: token)"))
    sequence_tis_cap: float = attrs.field(
        default=5.0, validator=_positive, metadata=_help("cap of prod_t rho_t (tis: sequence)")
    )
    sequence_mask: str = attrs.field(
        default="none", validator=_one_of("none", "geometric", "product"), metadata=_help("sequence mask type")
    )
    geo_mask_low: float = attrs.field(
        default=0.99, validator=_positive, metadata=_help("geometric mask: lowest exp(mean_t log rho_t) kept")
    )
    geo_mask_high: float = attrs.field(
        default=1.01, validator=[_positive, _at_least("geo_mask_low")],
        metadata=_help("geometric mask: highest exp(mean_t log rho_t) kept"),
    )
    product_mask_low: float = attrs.field(
        default=0.5, validator=_positive, metadata=_help("product mask: lowest prod_t rho_t kept")
    )
    product_mask_high: float = attrs.field(
        default=2.0, validator=[_positive, _at_least("product_mask_low")],
        metadata=_help("product mask: highest prod_t rho_t kept"),
    )
    outlier_token_low: float | None = attrs.field(
        default=None, validator=_positive, metadata=_help("drop a whole sample if any rho_t is below this (null: off)")
    )
    outlier_token_high: float | None = attrs.field(
        default=None, validator=[_positive, _at_least("outlier_token_low")],
        metadata=_help("drop a whole sample if any rho_t is above this (null: off)"),
    )
    token_mask_low: float | None = attrs.field(
        default=None, validator=_positive, metadata=_help("drop a token whose rho_t is below this (null: off)")
    )
    token_mask_high: float | None = attrs.field(
        default=None, validator=[_positive, _at_least("token_mask_low")],
        metadata=_help("drop a token whose rho_t is above this (null: off)"),
    )

    def any_enabled(self) -> bool:
        return (
            self.tis != "none"
            or self.sequence_mask != "none"
            or any(v is not None for v in (self.outlier_token_low, self.outlier_token_high,
                                           self.token_mask_low, self.token_mask_high))
        )


def _optional_one_of(*allowed: Any):
    check_value = _one_of(*allowed)

    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None:
            check_value(instance, attribute, value)

    check.allowed = allowed  # type: ignore[attr-defined]
    return check


@attrs.frozen(kw_only=True)
class DynamicSamplingConfig:
    """Groups whose rewards are all equal carry no group-relative signal (docs/algorithms.md)."""

    mode: str = attrs.field(
        default="none", validator=_one_of("none", "drop", "resample"),
        metadata=_help("none; drop: train on the other groups; resample: also sample more prompts to refill the step"),
    )
    max_sample_batches: int = attrs.field(
        default=30, validator=_positive,
        metadata=_help("resample: rollout batches per step at most (the first included); then train on what was kept"),
    )
    zero_variance_tol: float = attrs.field(
        default=0.0, validator=_non_negative, metadata=_help("rewards within this (max - min) count as equal")
    )


@attrs.frozen(kw_only=True)
class DistillationConfig:
    """On-policy distillation (docs/algorithms.md): a teacher replaces the reference policy."""

    teacher: str | None = attrs.field(default=None, metadata=_help(
        "teacher model directory (Hugging Face, the student's tokenizer); null: no distillation", path="input"))
    coef: float = attrs.field(default=1.0, validator=_non_negative,
                              metadata=_help("weight of the per-token advantage teacher logprob - student logprob"))
    reward_coef: float = attrs.field(default=0.0, validator=_non_negative,
                                     metadata=_help("weight of the environment reward's advantage mixed in"))


@attrs.frozen(kw_only=True)
class CriticConfig:
    """PPO's value model (docs/algorithms.md, "Critic"): trained beside the policy, read by ``gae``."""

    enabled: bool = attrs.field(default=False, metadata=_help("train a critic (needed by advantage gae, refused by others)"))
    path: str | None = attrs.field(default=None, metadata=_help(
        "the critic's body: a Hugging Face model directory with the policy's tokenizer; null: a copy of the "
        "policy's model (same initial weights). A value head starting at zero goes on top", path="input"))
    lr: float = attrs.field(default=1e-5, validator=_positive, metadata=_help("critic AdamW learning rate (constant)"))


@attrs.frozen(kw_only=True)
class AlgorithmConfig:
    policy_loss: Selection = _section(Selection, "policy loss", factory=lambda: Selection(name="ppo"))
    advantage: Selection = _section(Selection, "advantage estimator", factory=lambda: Selection(name="grpo"))
    loss_reduction: str | None = attrs.field(
        default=None,
        validator=_optional_one_of(
            "token_mean", "sequence_mean", "seq_mean_token_sum_norm", "prompt_mean", "token_mean_legacy"
        ),
        metadata=_help(
            "how per-token losses are reduced (null: the policy loss's own; a contradicting "
            "policy_loss.options.loss_reduction is an error)"
        ),
    )
    kl: KLConfig = _section(KLConfig, "KL regularisation", factory=KLConfig)
    entropy_coef: float = attrs.field(default=0.0, metadata=_help("entropy bonus coefficient"))
    off_policy: OffPolicyConfig = _section(OffPolicyConfig, "off-policy correction", factory=OffPolicyConfig)
    dynamic_sampling: DynamicSamplingConfig = _section(DynamicSamplingConfig, "groups whose rewards are all equal",
                                                       factory=DynamicSamplingConfig)
    value_clip: float = attrs.field(default=0.2, validator=_positive, metadata=_help("critic value clip (GAE)"))
    critic: CriticConfig = _section(CriticConfig, "value model for PPO with GAE", factory=CriticConfig)
    distillation: DistillationConfig = _section(DistillationConfig, "on-policy distillation from a teacher",
                                                factory=DistillationConfig)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.policy_loss.options, dict):  # structured options (raw dicts are not yet checked)
            from skyrl_core.algorithms.precedence import check_policy_loss_combination

            check_policy_loss_combination(self)


@attrs.frozen(kw_only=True)
class DataConfig:
    train: str | None = attrs.field(default=None, metadata=_help("train dataset: JSONL or parquet path", path="input"))
    eval: str | None = attrs.field(default=None, metadata=_help("eval dataset: JSONL or parquet path", path="input"))
    prompts_per_step: int = attrs.field(default=8, validator=_positive, metadata=_help("prompts per training step"))
    eval_size: int | None = attrs.field(default=None, metadata=_help("use the first N eval rows"))
    shuffle: bool = attrs.field(default=True, metadata=_help("shuffle train data each epoch"))
    env_class_from_rows: bool = attrs.field(
        default=False,
        metadata=_help("each row's env_class picks its environment (false: a row naming another than environment.name is an error)"),
    )


@attrs.frozen(kw_only=True)
class FullyAsyncConfig:
    """``trainer.mode: fully_async`` (docs/training.md)."""

    max_inflight: int = attrs.field(
        default=32, validator=_positive,
        metadata=_help("trajectories being generated at once, at most (whole groups of generation.n_samples)"),
    )
    max_staleness: int = attrs.field(
        default=1, validator=_non_negative,
        metadata=_help("policy versions a trained sample's oldest token may lag the trained policy"),
    )
    on_stale: str = attrs.field(
        default="drop", validator=_one_of("drop", "regenerate"),
        metadata=_help("a group over max_staleness: drop it, or drop it and generate its prompt again (counted in async/dropped)"),
    )
    kv_on_update: str = attrs.field(
        default="recompute", validator=_one_of("recompute", "keep"),
        metadata=_help("at each in-flight weight update, recompute: every paused sample's KV cache (and every cached "
                       "prefix) is dropped and recomputed from its tokens under the new weights, so each token is "
                       "sampled by exactly the policy version it carries; keep: paused samples keep the old "
                       "weights' keys/values (cheaper, but later tokens see them; docs/training.md)"),
    )


@attrs.frozen(kw_only=True)
class TrainerConfig:
    steps: int = attrs.field(default=10, validator=_positive, metadata=_help("training steps"))
    lr: float = attrs.field(default=1e-6, validator=_positive, metadata=_help("peak learning rate"))
    lr_schedule: str = attrs.field(default="constant", validator=_one_of("constant", "cosine", "linear"), metadata=_help("LR schedule"))
    warmup_steps: int = attrs.field(default=0, validator=_non_negative, metadata=_help("LR warm-up steps"))
    weight_decay: float = attrs.field(default=0.0, validator=_non_negative, metadata=_help("AdamW weight decay"))
    grad_clip: float = attrs.field(default=1.0, validator=_positive, metadata=_help("max grad norm"))
    mini_batches: int = attrs.field(default=1, validator=_positive, metadata=_help("optimizer steps per training step"))
    micro_batch_size: int = attrs.field(
        default=16, validator=_positive, metadata=_help("at most this many sequences per forward pass (per rank)")
    )
    micro_batch_tokens: int | None = attrs.field(
        default=4096, validator=_positive,
        metadata=_help("at most this many padded positions (rows x longest prompt+response) per forward pass "
                       "(per rank), besides micro_batch_size; a longer sequence runs alone, never split; "
                       "null: rows only"),
    )
    logprob_chunk_tokens: int = attrs.field(
        default=256, validator=_positive,
        metadata=_help("positions whose logits (x vocabulary) are computed at once in logprobs and loss"),
    )
    activation_checkpointing: bool = attrs.field(
        default=False, metadata=_help("recompute each decoder layer in backward instead of storing its activations")
    )
    engine_sleep: bool = attrs.field(
        default=False, metadata=_help("free the engine's KV cache (engine.sleep) while the trainer trains")
    )
    memory_check: bool = attrs.field(
        default=True, metadata=_help("refuse a run whose estimated peak memory exceeds what this process may use")
    )
    heap_mmap_threshold_mib: int | None = attrs.field(
        default=None, validator=_positive,
        metadata=_help("CPU: tensors of at least this many MiB get their own memory map, returned when freed "
                       "(null: 1024, every freed tensor stays in the heap for reuse: fastest, but the heap "
                       "fragments and keeps its high-water mark; 4: resident memory near the live tensors)"),
    )
    ppo_epochs: int = attrs.field(default=1, validator=_positive, metadata=_help("passes over each rollout batch"))
    eval_every: int = attrs.field(default=0, validator=_non_negative, metadata=_help("eval every k steps (0: start and end only)"))
    checkpoint_every: int = attrs.field(default=0, validator=_non_negative, metadata=_help("checkpoint every k steps (0: end only)"))
    output_dir: str = attrs.field(default="runs/default", metadata=_help("where metrics, plots and checkpoints go", path="output"))
    seed: int = attrs.field(default=0, metadata=_help("global seed"))
    resume: str | None = attrs.field(default=None, metadata=_help("checkpoint directory to resume from", path="output"))
    overwrite: bool = attrs.field(
        default=False,
        metadata=_help("start in a non-empty output_dir anyway, deleting the run files there (config.yaml, "
                       "metrics, plot, checkpoints/); false: such a directory is refused unless resumed"),
    )
    mode: str = attrs.field(
        default="sync", validator=_one_of("sync", "one_step_off", "fully_async"),
        metadata=_help("sync: generate, then train; one_step_off: generate step k+1 while step k trains; "
                       "fully_async: generation never waits, weights updated in flight (docs/training.md)"),
    )
    fully_async: FullyAsyncConfig = _section(FullyAsyncConfig, "trainer.mode=fully_async", factory=FullyAsyncConfig)
    reuse_rollout_logprobs: bool = attrs.field(
        default=False, metadata=_help("use engine logprobs as old logprobs (only safe with a verified execution contract)")
    )
    plot: bool = attrs.field(default=True, metadata=_help("write reward/eval plot PNG at the end"))
    progress: bool = attrs.field(default=True, metadata=_help("show progress bars"))
    loggers: tuple[str, ...] = attrs.field(
        default=("jsonl",), converter=tuple,
        metadata=_help("metrics loggers: jsonl (always on), tensorboard, wandb (offline), mlflow (skyrl-loggers)"),
    )


@attrs.frozen(kw_only=True)
class RolloutConfig:
    max_turns: int = attrs.field(default=1, validator=_positive, metadata=_help("max model turns per episode"))
    stepwise: bool = attrs.field(default=False, metadata=_help("one training sample per turn"))
    max_prompt_tokens: int = attrs.field(default=512, validator=_positive, metadata=_help("prompt tokens cap"))
    max_response_tokens: int | None = attrs.field(
        default=None, validator=_positive,
        metadata=_help("cap on an episode's response tokens over all turns, model and environment (default: no cap)"),
    )
    env_workers: int = attrs.field(
        default=1, validator=_positive,
        metadata=_help("episodes whose environment steps (tool calls) run at once, in threads (1: one after another)"),
    )


@attrs.frozen(kw_only=True)
class Config:
    """A whole run."""

    model: ModelConfig = _section(ModelConfig, "the policy model")
    engine: EngineConfig = _section(EngineConfig, "inference engine", factory=lambda: EngineConfig(name="torch"))
    backend: Selection = _section(Selection, "training backend", factory=lambda: Selection(name="fsdp"))
    environment: Selection = _section(Selection, "the environment of every row (see data.env_class_from_rows)",
                                      factory=lambda: Selection(name="arithmetic"))
    algorithm: AlgorithmConfig = _section(AlgorithmConfig, "RL algorithm", factory=AlgorithmConfig)
    generation: GenerationConfig = _section(GenerationConfig, "sampling", factory=GenerationConfig)
    rollout: RolloutConfig = _section(RolloutConfig, "rollouts", factory=RolloutConfig)
    data: DataConfig = _section(DataConfig, "datasets", factory=DataConfig)
    trainer: TrainerConfig = _section(TrainerConfig, "training loop", factory=TrainerConfig)
    plugins: dict[str, Any] = attrs.field(factory=dict, metadata=_help("sections added by plugins (e.g. isoexec)"))
