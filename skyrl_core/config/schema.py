"""The config schema: frozen attrs classes. ``help`` metadata is shown by ``skyrl config show --help``
and in docs/config.md.

Selectable sections (``engine``, ``backend``, ``algorithm.policy_loss``, ...) are ``Selection``:
``{name, options}``. ``name`` is checked against what plugins registered, then ``options`` is
structured with that plugin's own options class (see ``skyrl_core.config.loader``).
"""

from __future__ import annotations

from typing import Any

import attrs


def _help(text: str, **kw: Any) -> dict[str, Any]:
    return {"help": text, **kw}


def _positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and value <= 0:
        raise ValueError("must be > 0")


def _non_negative(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and value < 0:
        raise ValueError("must be >= 0")


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


@attrs.frozen(kw_only=True)
class ModelConfig:
    """Where the policy comes from: a local directory, or a Hugging Face config to build randomly."""

    path: str | None = attrs.field(default=None, metadata=_help("local Hugging Face model directory"))
    config: dict[str, Any] | None = attrs.field(
        default=None, metadata=_help("a transformers config dict (with model_type) to build a random model")
    )
    tokenizer: str | None = attrs.field(default=None, metadata=_help("tokenizer directory (default: path)"))
    dtype: str = attrs.field(
        default="float32", validator=_one_of("float32", "bfloat16"), metadata=_help("parameter dtype")
    )

    def __attrs_post_init__(self) -> None:
        if (self.path is None) == (self.config is None):
            raise ValueError("exactly one of model.path and model.config must be set")


@attrs.frozen(kw_only=True)
class GenerationConfig:
    max_new_tokens: int = attrs.field(default=64, validator=_positive, metadata=_help("tokens per response"))
    temperature: float = attrs.field(default=1.0, validator=_non_negative, metadata=_help("sampling temperature"))
    top_p: float = attrs.field(default=1.0, validator=_positive, metadata=_help("nucleus sampling mass"))
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


@attrs.frozen(kw_only=True)
class OffPolicyConfig:
    """Corrections for a trainer/engine mismatch, for when IsoExec is off."""

    tis: str = attrs.field(default="none", validator=_one_of("none", "token", "sequence"), metadata=_help("truncated IS level"))
    tis_cap: float = attrs.field(default=2.0, validator=_positive, metadata=_help("TIS ratio cap"))
    sequence_mask: str = attrs.field(
        default="none", validator=_one_of("none", "geometric", "product"), metadata=_help("sequence mask type")
    )
    mask_low: float = attrs.field(default=0.5, validator=_positive, metadata=_help("sequence mask lower bound"))
    mask_high: float = attrs.field(default=2.0, validator=_positive, metadata=_help("sequence mask upper bound"))
    token_mask_low: float | None = attrs.field(default=None, metadata=_help("per-token mask lower ratio bound"))
    token_mask_high: float | None = attrs.field(default=None, metadata=_help("per-token mask upper ratio bound"))


@attrs.frozen(kw_only=True)
class AlgorithmConfig:
    policy_loss: Selection = attrs.field(factory=lambda: Selection(name="ppo"), metadata=_help("policy loss"))
    advantage: Selection = attrs.field(factory=lambda: Selection(name="grpo"), metadata=_help("advantage estimator"))
    loss_reduction: str = attrs.field(
        default="token_mean",
        validator=_one_of("token_mean", "sequence_mean", "seq_mean_token_sum_norm", "prompt_mean"),
        metadata=_help("how per-token losses are reduced"),
    )
    kl: KLConfig = attrs.field(factory=KLConfig, metadata=_help("KL regularisation"))
    entropy_coef: float = attrs.field(default=0.0, metadata=_help("entropy bonus coefficient"))
    off_policy: OffPolicyConfig = attrs.field(factory=OffPolicyConfig, metadata=_help("off-policy correction"))
    dynamic_sampling: bool = attrs.field(default=False, metadata=_help("drop groups whose rewards are all equal"))
    value_clip: float = attrs.field(default=0.2, validator=_positive, metadata=_help("critic value clip (GAE)"))


@attrs.frozen(kw_only=True)
class DataConfig:
    train: str | None = attrs.field(default=None, metadata=_help("train dataset: JSONL or parquet path"))
    eval: str | None = attrs.field(default=None, metadata=_help("eval dataset: JSONL or parquet path"))
    prompts_per_step: int = attrs.field(default=8, validator=_positive, metadata=_help("prompts per training step"))
    eval_size: int | None = attrs.field(default=None, metadata=_help("use the first N eval rows"))
    shuffle: bool = attrs.field(default=True, metadata=_help("shuffle train data each epoch"))


@attrs.frozen(kw_only=True)
class TrainerConfig:
    steps: int = attrs.field(default=10, validator=_positive, metadata=_help("training steps"))
    lr: float = attrs.field(default=1e-6, validator=_positive, metadata=_help("peak learning rate"))
    lr_schedule: str = attrs.field(default="constant", validator=_one_of("constant", "cosine", "linear"), metadata=_help("LR schedule"))
    warmup_steps: int = attrs.field(default=0, validator=_non_negative, metadata=_help("LR warm-up steps"))
    weight_decay: float = attrs.field(default=0.0, validator=_non_negative, metadata=_help("AdamW weight decay"))
    grad_clip: float = attrs.field(default=1.0, validator=_positive, metadata=_help("max grad norm"))
    mini_batches: int = attrs.field(default=1, validator=_positive, metadata=_help("optimizer steps per training step"))
    micro_batch_size: int = attrs.field(default=16, validator=_positive, metadata=_help("sequences per forward pass"))
    ppo_epochs: int = attrs.field(default=1, validator=_positive, metadata=_help("passes over each rollout batch"))
    eval_every: int = attrs.field(default=0, validator=_non_negative, metadata=_help("eval every k steps (0: start and end only)"))
    checkpoint_every: int = attrs.field(default=0, validator=_non_negative, metadata=_help("checkpoint every k steps (0: end only)"))
    output_dir: str = attrs.field(default="runs/default", metadata=_help("where metrics, plots and checkpoints go"))
    seed: int = attrs.field(default=0, metadata=_help("global seed"))
    resume: str | None = attrs.field(default=None, metadata=_help("checkpoint directory to resume from"))
    mode: str = attrs.field(default="sync", validator=_one_of("sync", "one_step_off", "fully_async"), metadata=_help("training mode"))
    reuse_rollout_logprobs: bool = attrs.field(
        default=False, metadata=_help("use engine logprobs as old logprobs (only safe with a verified execution contract)")
    )
    plot: bool = attrs.field(default=True, metadata=_help("write reward/eval plot PNG at the end"))
    progress: bool = attrs.field(default=True, metadata=_help("show progress bars"))


@attrs.frozen(kw_only=True)
class RolloutConfig:
    max_turns: int = attrs.field(default=1, validator=_positive, metadata=_help("max model turns per episode"))
    stepwise: bool = attrs.field(default=False, metadata=_help("one training sample per turn"))
    max_prompt_tokens: int = attrs.field(default=512, validator=_positive, metadata=_help("prompt tokens cap"))
    max_response_tokens: int | None = attrs.field(
        default=None, validator=_positive,
        metadata=_help("cap on an episode's response tokens over all turns, model and environment (default: no cap)"),
    )


@attrs.frozen(kw_only=True)
class Config:
    """A whole run."""

    model: ModelConfig = attrs.field(metadata=_help("the policy model"))
    engine: Selection = attrs.field(factory=lambda: Selection(name="torch"), metadata=_help("inference engine"))
    backend: Selection = attrs.field(factory=lambda: Selection(name="fsdp"), metadata=_help("training backend"))
    environment: Selection = attrs.field(factory=lambda: Selection(name="arithmetic"), metadata=_help("default environment"))
    algorithm: AlgorithmConfig = attrs.field(factory=AlgorithmConfig, metadata=_help("RL algorithm"))
    generation: GenerationConfig = attrs.field(factory=GenerationConfig, metadata=_help("sampling"))
    rollout: RolloutConfig = attrs.field(factory=RolloutConfig, metadata=_help("rollouts"))
    data: DataConfig = attrs.field(factory=DataConfig, metadata=_help("datasets"))
    trainer: TrainerConfig = attrs.field(factory=TrainerConfig, metadata=_help("training loop"))
    plugins: dict[str, Any] = attrs.field(factory=dict, metadata=_help("sections added by plugins (e.g. isoexec)"))
    loggers: tuple[str, ...] = attrs.field(
        default=("jsonl",), converter=tuple,
        metadata=_help("metrics loggers: jsonl (always on), tensorboard, wandb (offline), mlflow (skyrl-loggers)"),
    )
