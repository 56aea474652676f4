"""Translate an upstream SkyRL (skyrl-train) YAML config into this project's config.

Upstream's layout is its ``ppo_base_config.yaml`` / ``SkyRLTrainConfig``: ``data.train_data``,
``trainer.policy.model.path``, ``trainer.algorithm.*``, ``generator.*``, ``environment.env_class``.
``translate_upstream(data)`` returns this project's config data and one ``Note`` per upstream key
that has no equivalent here (or whose value cannot be carried over), so nothing is dropped silently.

A key the upstream file leaves out takes upstream's default (``UPSTREAM_DEFAULTS``, from upstream's
``skyrl/train/config/config.py``) where this project's default differs, so the translated run
behaves like the upstream one (e.g. upstream adds a k3 KL loss with coefficient 0.001 by default).
OmegaConf interpolations ``${a.b}`` (another key) and ``${oc.env:VAR}`` are resolved; others are
reported.
"""

from __future__ import annotations

import os
import re
from typing import Any

import attrs

# Upstream defaults of the keys translated below (upstream skyrl/train/config/config.py, 2026-08).
UPSTREAM_DEFAULTS: dict[str, Any] = {
    "trainer.algorithm.advantage_estimator": "grpo",
    "trainer.algorithm.policy_loss_type": "regular",
    "trainer.algorithm.loss_reduction": "token_mean",
    "trainer.algorithm.eps_clip_low": 0.2,
    "trainer.algorithm.eps_clip_high": 0.2,
    "trainer.algorithm.clip_ratio_c": 3.0,
    "trainer.algorithm.grpo_norm_by_std": True,
    "trainer.algorithm.lambd": 1.0,
    "trainer.algorithm.gamma": 1.0,
    "trainer.algorithm.use_kl_loss": True,
    "trainer.algorithm.use_kl_in_reward": False,
    "trainer.algorithm.kl_loss_coef": 0.001,
    "trainer.algorithm.kl_estimator_type": "k3",
    "trainer.algorithm.kl_ctrl.type": "fixed",
    "trainer.algorithm.kl_ctrl.kl_target": 0.1,
    "trainer.algorithm.kl_ctrl.horizon": 10000,
    "trainer.algorithm.use_entropy_loss": False,
    "trainer.algorithm.entropy_loss_coef": 0.01,
    "trainer.algorithm.cispo.cispo_eps_clip_low": 1.0,
    "trainer.algorithm.cispo.cispo_eps_clip_high": 4.0,
    "trainer.algorithm.cispo.cispo_anchor": "old",
    "trainer.algorithm.dppo.dppo_type": "binary_tv",
    "trainer.algorithm.dppo.delta_low": 0.2,
    "trainer.algorithm.dppo.delta_high": 0.2,
    "trainer.algorithm.sapo.tau_pos": 1.0,
    "trainer.algorithm.sapo.tau_neg": 1.05,
    "trainer.algorithm.clip_cov.clip_ratio": 0.0002,
    "trainer.algorithm.clip_cov.clip_cov_lb": 1.0,
    "trainer.algorithm.clip_cov.clip_cov_ub": 5.0,
    "trainer.algorithm.kl_cov.kl_cov_frac": 0.2,
    "trainer.algorithm.kl_cov.ppo_kl_coef": 1.0,
    "trainer.algorithm.off_policy_correction.token_tis_ratio_clip_high": 2.0,
    "trainer.algorithm.off_policy_correction.sequence_tis_ratio_clip_high": 5.0,
    "trainer.algorithm.off_policy_correction.geo_mask_low": 0.99,
    "trainer.algorithm.off_policy_correction.geo_mask_high": 1.01,
    "trainer.algorithm.off_policy_correction.product_mask_low": 0.5,
    "trainer.algorithm.off_policy_correction.product_mask_high": 2.0,
    "trainer.algorithm.dynamic_sampling.max_sample_batches": 30,
    "trainer.algorithm.zero_variance_filter_tol": 1e-6,
}

POLICY_LOSSES = {
    "regular": "ppo", "dual_clip": "dual_clip", "gspo": "gspo", "clip_cov": "clip_cov", "kl_cov": "kl_cov",
    "cispo": "cispo", "sapo": "sapo", "rollout_is": "rollout_is", "dppo": "dppo",
    "cross_entropy": "cross_entropy", "importance_sampling": "importance_sampling",
}
# losses whose PPO-style clip comes from upstream's trainer.algorithm.eps_clip_low/high
_CLIPPED_LOSSES = {"ppo", "dual_clip", "gspo", "clip_cov", "rollout_is"}
# per-loss option sections: upstream key under trainer.algorithm -> (loss, our option)
_LOSS_OPTIONS = {
    "clip_ratio_c": ("dual_clip", "clip_ratio_c"),
    "sapo.tau_pos": ("sapo", "tau_pos"),
    "sapo.tau_neg": ("sapo", "tau_neg"),
    "clip_cov.clip_ratio": ("clip_cov", "clip_ratio"),
    "clip_cov.clip_cov_lb": ("clip_cov", "cov_low"),
    "clip_cov.clip_cov_ub": ("clip_cov", "cov_high"),
    "kl_cov.kl_cov_frac": ("kl_cov", "kl_ratio"),
    "kl_cov.ppo_kl_coef": ("kl_cov", "kl_coef"),
    "cispo.cispo_eps_clip_low": ("cispo", "eps_low"),
    "cispo.cispo_eps_clip_high": ("cispo", "eps_high"),
    "cispo.cispo_anchor": ("cispo", "anchor"),
    "dppo.dppo_type": ("dppo", "divergence"),
    "dppo.delta_low": ("dppo", "delta_low"),
    "dppo.delta_high": ("dppo", "delta_high"),
}
_OFF_POLICY = {
    "token_tis_ratio_clip_high": "token_tis_cap",
    "sequence_tis_ratio_clip_high": "sequence_tis_cap",
    "geo_mask_low": "geo_mask_low",
    "geo_mask_high": "geo_mask_high",
    "product_mask_low": "product_mask_low",
    "product_mask_high": "product_mask_high",
    "outlier_token_is_threshold_low": "outlier_token_low",
    "outlier_token_is_threshold_high": "outlier_token_high",
    "token_mask_is_threshold_low": "token_mask_low",
    "token_mask_is_threshold_high": "token_mask_high",
}
# one-to-one keys: upstream -> ours (value unchanged)
_DIRECT = {
    "trainer.policy.model.path": "model.path",
    "trainer.seed": "trainer.seed",
    "trainer.policy.optimizer_config.lr": "trainer.lr",
    "trainer.policy.optimizer_config.weight_decay": "trainer.weight_decay",
    "trainer.policy.optimizer_config.max_grad_norm": "trainer.grad_clip",
    "trainer.policy.optimizer_config.num_warmup_steps": "trainer.warmup_steps",
    "trainer.update_epochs_per_batch": "trainer.ppo_epochs",
    "trainer.micro_train_batch_size_per_gpu": "trainer.micro_batch_size",
    "trainer.max_prompt_length": "rollout.max_prompt_tokens",
    "trainer.algorithm.value_clip": "algorithm.value_clip",
    "generator.n_samples_per_prompt": "generation.n_samples",
    "generator.max_turns": "rollout.max_turns",
    "generator.step_wise_trajectories": "rollout.stepwise",
    "generator.sampling_params.max_generate_length": "generation.max_new_tokens",
    "generator.sampling_params.temperature": "generation.temperature",
    "generator.sampling_params.top_p": "generation.top_p",
    "generator.eval_sampling_params.temperature": "generation.eval_temperature",
    "generator.eval_n_samples_per_prompt": "generation.eval_n_samples",
    "environment.env_class": "environment",
}
# upstream values that change nothing there (identity sampling settings and the like): no note needed
_NEUTRAL = {
    "generator.sampling_params.repetition_penalty": 1.0,
    "generator.sampling_params.min_p": 0.0,
    "generator.eval_sampling_params.repetition_penalty": 1.0,
    "generator.eval_sampling_params.min_p": 0.0,
    "generator.eval_sampling_params.top_p": 1.0,
    "generator.eval_sampling_params.top_k": -1,
    "generator.eval_sampling_params.stop": None,
    "generator.sampling_params.logprobs": 1,  # the sampled token's logprob is always recorded here
}


@attrs.frozen
class Note:
    """An upstream key not carried over, with its value and why."""

    key: str
    value: Any
    reason: str

    def __str__(self) -> str:
        return f"{self.key} = {self.value!r}: {self.reason}"


class UpstreamConfigError(ValueError):
    """The input is not an upstream SkyRL config this translator can read."""


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; empty mappings are kept as leaves."""
    if isinstance(data, dict) and data:
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: data}


_INTERPOLATION = re.compile(r"\$\{([^}]*)\}")
# YAML 1.1 reads 1e-2 as a string; OmegaConf (upstream's loader) reads it as a float
_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _resolve(flat: dict[str, Any], notes: list[Note]) -> dict[str, Any]:
    """Resolve ``${other.key}`` and ``${oc.env:VAR}``; a value that cannot be resolved becomes a note."""
    resolved: dict[str, Any] = {}

    def value_of(key: str, seen: tuple[str, ...]) -> Any:
        if key in resolved:
            return resolved[key]
        return resolve_value(key, flat[key], seen)

    def resolve_value(key: str, raw: Any, seen: tuple[str, ...]) -> Any:
        if isinstance(raw, list):
            return [resolve_value(key, item, seen) for item in raw]
        if not isinstance(raw, str):
            return raw
        if _FLOAT.fullmatch(raw):
            return float(raw)
        if "${" not in raw:
            return raw
        whole = _INTERPOLATION.fullmatch(raw)
        if whole and whole.group(1) in flat and whole.group(1) not in seen:
            return value_of(whole.group(1), (*seen, key))  # keeps the referenced value's type

        def substitute(match: re.Match) -> str:
            ref = match.group(1)
            if ref.startswith("oc.env:"):
                name, _, default = ref[len("oc.env:"):].partition(",")
                if name in os.environ:
                    return os.environ[name]
                if default:
                    return default.strip()
            elif ref in flat and ref not in seen:
                return str(value_of(ref, (*seen, key)))
            raise KeyError(ref)

        return _INTERPOLATION.sub(substitute, raw)

    for key in flat:
        try:
            resolved[key] = value_of(key, ())
        except KeyError as exc:
            notes.append(Note(key, flat[key], f"interpolation ${{{exc.args[0]}}} cannot be resolved here"))
            resolved[key] = None
    return resolved


class _Translation:
    def __init__(self, flat: dict[str, Any]) -> None:
        self.notes: list[Note] = []
        self.given = _resolve(flat, self.notes)
        self.unresolved = {n.key for n in self.notes}
        self.used: set[str] = set(self.unresolved)
        self.out: dict[str, Any] = {}

    def get(self, key: str) -> Any:
        """The upstream value of ``key`` (the file's, else upstream's default), marked as used."""
        self.used.add(key)
        return self.given[key] if key in self.given else UPSTREAM_DEFAULTS.get(key)

    def has(self, key: str) -> bool:
        return key in self.given

    def put(self, ours: str, value: Any) -> None:
        node = self.out
        *parents, leaf = ours.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value

    def note(self, key: str, reason: str) -> None:
        self.used.add(key)
        if key in self.given and key not in self.unresolved:
            self.notes.append(Note(key, self.given[key], reason))

    def ignore(self, keys: list[str], reason: str) -> None:
        for key in keys:
            self.note(key, reason)


def translate_upstream(data: dict[str, Any]) -> tuple[dict[str, Any], list[Note]]:
    """This project's config data for an upstream SkyRL config, and the notes (see the module doc)."""
    if not isinstance(data, dict) or not ({"trainer", "generator"} & set(data)):
        raise UpstreamConfigError(
            "not an upstream SkyRL config: expected top-level 'trainer' and/or 'generator' sections "
            "(the layout of upstream's ppo_base_config.yaml)"
        )
    t = _Translation(flatten(data))
    for upstream_key, ours in _DIRECT.items():
        if t.has(upstream_key):
            t.put(ours, t.get(upstream_key))
    _data(t)
    _batches(t)
    _schedule_and_intervals(t)
    _generator(t)
    _algorithm(t)
    for key, value in t.given.items():
        if key in t.used:
            continue
        if key in _NEUTRAL and value == _NEUTRAL[key]:
            continue
        t.notes.append(Note(key, value, "no equivalent in skyrl"))
    return t.out, t.notes


def _data(t: _Translation) -> None:
    for upstream_key, ours in (("data.train_data", "data.train"), ("data.val_data", "data.eval")):
        if not t.has(upstream_key):
            continue
        files = t.get(upstream_key)
        files = [files] if isinstance(files, str) else list(files or [])
        if files:
            t.put(ours, files[0])
        if len(files) > 1:
            t.notes.append(Note(upstream_key, files, f"{ours} takes one file: only the first was kept"))
    # keys that must repeat another key's value: consumed when they do, reported when they do not
    for key, same_as, reason in (
        ("generator.model_name", "trainer.policy.model.path", "the engine always serves the policy (model.path)"),
        ("trainer.ref.model.path", "trainer.policy.model.path", "the reference policy is the initial policy (model.path)"),
        ("generator.eval_sampling_params.max_generate_length", "generator.sampling_params.max_generate_length",
         "evaluation samples up to generation.max_new_tokens too"),
    ):
        if t.has(key) and t.has(same_as) and t.get(key) != t.get(same_as):
            t.note(key, reason)
        elif t.has(key) and t.has(same_as):
            t.used.add(key)


def _batches(t: _Translation) -> None:
    if t.has("trainer.train_batch_size"):
        prompts = t.get("trainer.train_batch_size")
        t.put("data.prompts_per_step", prompts)
        if t.has("trainer.policy_mini_batch_size"):
            mini = t.get("trainer.policy_mini_batch_size")
            if isinstance(prompts, int) and isinstance(mini, int) and mini > 0 and prompts % mini == 0:
                t.put("trainer.mini_batches", prompts // mini)
            else:
                t.note("trainer.policy_mini_batch_size", "trainer.mini_batches needs train_batch_size / "
                       "policy_mini_batch_size to be a whole number")
    t.ignore(["trainer.epochs"], "no equivalent: set trainer.steps (this project counts steps, not epochs)")


def _schedule_and_intervals(t: _Translation) -> None:
    key = "trainer.policy.optimizer_config.scheduler"
    if t.has(key):
        name = str(t.get(key))
        schedule = next((s for s in ("cosine", "linear", "constant") if s in name), None)
        if schedule:
            t.put("trainer.lr_schedule", schedule)
        else:
            t.note(key, "trainer.lr_schedule is one of constant, cosine, linear")
    for upstream_key, ours in (("trainer.eval_interval", "trainer.eval_every"),
                               ("trainer.ckpt_interval", "trainer.checkpoint_every")):
        if t.has(upstream_key):
            value = t.get(upstream_key)
            if isinstance(value, int) and value > 0:
                t.put(ours, value)
            else:
                t.note(upstream_key, f"{ours} is >= 0 (0: at the start/end only); off is not available")
    if t.has("trainer.resume_mode"):
        mode = t.get("trainer.resume_mode")
        if mode == "from_path" and t.get("trainer.resume_path"):
            t.put("trainer.resume", t.get("trainer.resume_path"))
        elif mode not in (None, "none"):
            t.note("trainer.resume_mode", "set trainer.resume to a checkpoint directory to resume")
    t.used.add("trainer.resume_path")
    if t.has("trainer.strategy"):
        strategy = t.get("trainer.strategy")
        if strategy in ("fsdp", "fsdp2", "megatron"):
            t.put("backend", "megatron" if strategy == "megatron" else "fsdp")
        else:
            t.note("trainer.strategy", "backends here: fsdp, megatron")


def _generator(t: _Translation) -> None:
    if t.has("generator.backend"):
        backend = t.get("generator.backend")
        if backend in ("vllm", "sglang"):
            t.put("engine", backend)
        else:
            t.note("generator.backend", "engines here: torch, vllm, sglang, openai")
    if t.has("generator.sampling_params.top_k"):
        top_k = t.get("generator.sampling_params.top_k")
        t.put("generation.top_k", 0 if top_k is not None and top_k < 0 else top_k)  # upstream -1: off; here 0
    if t.has("generator.sampling_params.stop"):
        stop = t.get("generator.sampling_params.stop")
        if stop:
            t.put("generation.stop", [stop] if isinstance(stop, str) else list(stop))


def _algorithm(t: _Translation) -> None:
    a = "trainer.algorithm."
    estimator = t.get(a + "advantage_estimator")
    t.put("algorithm.advantage.name", estimator)
    advantage_options: dict[str, Any] = {}
    if estimator == "grpo":
        advantage_options["norm_by_std"] = t.get(a + "grpo_norm_by_std")
    else:
        t.note(a + "grpo_norm_by_std", f"only used by grpo (advantage_estimator is {estimator!r})")
    if estimator == "gae":
        advantage_options.update(gamma=t.get(a + "gamma"), lam=t.get(a + "lambd"))
    elif estimator == "reinforce++":
        advantage_options["gamma"] = t.get(a + "gamma")
        t.note(a + "lambd", "only used by gae")
    else:
        t.ignore([a + "gamma", a + "lambd"], f"only used by gae/reinforce++ (advantage_estimator is {estimator!r})")
    if t.has(a + "advantage_batch_normalize") and t.get(a + "advantage_batch_normalize"):
        if estimator in ("grpo", "rloo", "maxrl"):
            advantage_options["whiten"] = True
        else:
            t.note(a + "advantage_batch_normalize", f"{estimator} whitens by itself or not at all here")
    t.used.add(a + "advantage_batch_normalize")
    if advantage_options:
        t.put("algorithm.advantage.options", advantage_options)

    loss_type = t.get(a + "policy_loss_type")
    loss = POLICY_LOSSES.get(loss_type)
    if loss is None:
        t.note(a + "policy_loss_type", f"policy losses here: {', '.join(sorted(POLICY_LOSSES))} (upstream names)")
        loss = "ppo"
    t.put("algorithm.policy_loss.name", loss)
    options: dict[str, Any] = {}
    if loss in _CLIPPED_LOSSES:
        options.update(eps_low=t.get(a + "eps_clip_low"), eps_high=t.get(a + "eps_clip_high"))
    else:
        t.ignore([a + "eps_clip_low", a + "eps_clip_high"], f"not used by {loss}")
    for upstream_key, (owner, ours) in _LOSS_OPTIONS.items():
        if owner == loss:
            options[ours] = t.get(a + upstream_key)
        else:
            t.note(a + upstream_key, f"only used by {owner}")
    reduction = t.get(a + "loss_reduction")
    t.put("algorithm.loss_reduction", reduction)
    if t.has(a + "max_seq_len") and t.get(a + "max_seq_len") is not None:
        if reduction == "seq_mean_token_sum_norm":
            options["norm_len"] = t.get(a + "max_seq_len")
        else:
            t.note(a + "max_seq_len", "only used by seq_mean_token_sum_norm")
    t.used.add(a + "max_seq_len")
    if options:
        t.put("algorithm.policy_loss.options", options)

    _kl_and_entropy(t, a)
    _off_policy(t, a)
    _dynamic_sampling(t, a)
    t.ignore([a + "temperature"], "the loss uses the logprobs at the sampling temperature (generation.temperature)")


def _kl_and_entropy(t: _Translation, a: str) -> None:
    in_loss, in_reward = t.get(a + "use_kl_loss"), t.get(a + "use_kl_in_reward")
    if in_loss and in_reward:
        t.note(a + "use_kl_in_reward", "use_kl_loss and use_kl_in_reward are exclusive: the KL loss was kept")
    use_as = "loss" if in_loss else "reward" if in_reward else "none"
    kl: dict[str, Any] = {"use_as": use_as}
    if use_as != "none":
        kl.update(coef=t.get(a + "kl_loss_coef"), estimator=t.get(a + "kl_estimator_type"))
    else:
        t.ignore([a + "kl_loss_coef", a + "kl_estimator_type"], "KL is off (use_kl_loss and use_kl_in_reward false)")
    if use_as == "reward" and t.get(a + "kl_ctrl.type") == "adaptive":
        kl.update(adaptive_target=t.get(a + "kl_ctrl.kl_target"), adaptive_horizon=t.get(a + "kl_ctrl.horizon"))
    else:
        t.ignore([a + "kl_ctrl.type", a + "kl_ctrl.kl_target", a + "kl_ctrl.horizon"],
                 "the adaptive KL controller applies to the KL reward penalty only")
    t.put("algorithm.kl", kl)
    if t.get(a + "use_entropy_loss"):
        t.put("algorithm.entropy_coef", t.get(a + "entropy_loss_coef"))
    else:
        t.ignore([a + "entropy_loss_coef"], "the entropy loss is off (use_entropy_loss false)")


def _off_policy(t: _Translation, a: str) -> None:
    o = a + "off_policy_correction."
    section: dict[str, Any] = {}
    tis = t.get(o + "tis_ratio_type")
    if tis is None and t.get(a + "use_tis"):  # upstream's deprecated spelling of token TIS
        tis = "token"
        cap = t.get(a + "tis_imp_ratio_cap")
        if isinstance(cap, (int, float)) and cap > 0:
            section["token_tis_cap"] = cap
    t.used.add(a + "tis_imp_ratio_cap")
    section["tis"] = tis or "none"
    section["sequence_mask"] = t.get(o + "sequence_mask_metric") or "none"
    for upstream_key, ours in _OFF_POLICY.items():
        value = t.get(o + upstream_key)
        if value is not None:
            section.setdefault(ours, value)
    if t.get(o + "token_mask_is_threshold_low") is None or t.get(o + "token_mask_is_threshold_high") is None:
        # upstream applies its token mask only with both bounds set; here one bound alone is a mask
        for ours in ("token_mask_low", "token_mask_high"):
            if section.pop(ours, None) is not None:
                t.note(o + ours.replace("token_mask", "token_mask_is_threshold"),
                       "upstream ignores a token-mask bound without the other: not carried over")
    t.put("algorithm.off_policy", section)


def _dynamic_sampling(t: _Translation, a: str) -> None:
    kind = t.get(a + "dynamic_sampling.type")
    section: dict[str, Any] = {}
    if kind == "filter":
        section["mode"] = "resample"
        limit = t.get(a + "dynamic_sampling.max_sample_batches")
        if isinstance(limit, int) and limit > 0:
            section["max_sample_batches"] = limit
        else:
            t.note(a + "dynamic_sampling.max_sample_batches",
                   "sampling forever is not offered: max_sample_batches keeps this project's default")
    else:
        t.ignore([a + "dynamic_sampling.max_sample_batches"], "only used by dynamic_sampling.type filter")
        if kind == "replace":
            t.note(a + "dynamic_sampling.type", "'replace' (POLARIS) is not built here; 'filter' is (mode: resample)")
        elif t.get(a + "zero_variance_filter"):
            section["mode"] = "drop"
    t.ignore([a + "dynamic_sampling.min_replace_ratio"], "only used by dynamic_sampling.type replace (not built)")
    if section.get("mode"):
        section["zero_variance_tol"] = t.get(a + "zero_variance_filter_tol") if t.get(a + "zero_variance_filter") else 0.0
    else:
        t.used.add(a + "zero_variance_filter_tol")
    t.used.add(a + "zero_variance_filter")
    if section:
        t.put("algorithm.dynamic_sampling", section)


def render(config: dict[str, Any], notes: list[Note], source: str) -> str:
    """The translated config as YAML, headed by comments that name every key not carried over."""
    import yaml

    lines = [f"# Translated from the upstream SkyRL config {source} by `skyrl config import-upstream`."]
    if notes:
        lines.append(f"# {len(notes)} upstream key(s) not carried over:")
        lines += [f"#   {note}" for note in notes]
    return "\n".join(lines) + "\n" + yaml.safe_dump(config, sort_keys=False)

