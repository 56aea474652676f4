"""Before the first step: the peak memory of the configured training step, against what this process
may use. A run the kernel would kill mid-step (silently, from its point of view) is refused instead,
with the knobs that lower the peak.

The estimate adds, on one machine:
- the trainer's fp32 weights, gradients and AdamW moments: 26 bytes a parameter, measured on the
  FSDP backend (weights held as loaded and as shards: 2.6 copies; gradients gathered and reduced:
  2 copies; two AdamW moments), the reference policy's weights (KL), the engine's weights twice
  (as loaded and as packed GEMM operands), and a full weight copy when weights are synced;
- the activations autograd keeps for the largest micro-batch (every decoder layer's intermediate
  tensors, or only layer inputs plus one layer with ``trainer.activation_checkpointing``), and its
  attention mask;
- one chunk of logits (``trainer.logprob_chunk_tokens`` positions x vocabulary) and its copies;
- the engine's KV cache for the samples decoded together, or its ``kv_cache_memory_bytes`` when
  given (skyrl-torch holds at most that, vLLM all of it);
- this process as it is now (interpreter, libraries), and each further rank process.
Per-token activation sizes were measured on SmolLM2 (autograd's saved tensors, fp32, SDPA): about
52 KiB per token per layer at hidden 576 / intermediate 1536; the formula below is 1.1x that.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import attrs

from skyrl_core.config.errors import ConfigError, ConfigIssue
from skyrl_core.config.schema import Config

GIB = 1024**3
FP32 = 4
RANK_PROCESS_BYTES = 600 * 1024**2  # a further Python process with torch and transformers imported
TRAINER_BYTES_PER_PARAMETER = 26  # fp32: 2.6 weight copies + 2 gradient copies + 2 AdamW moments, x 4 bytes
LOGIT_COPIES = 6  # logits, log-softmax, its exp (entropy), and their gradients in backward


@attrs.frozen
class MemoryEstimate:
    """Bytes by part; ``total`` is their sum."""

    parts: dict[str, int]
    largest_micro_batch_tokens: int

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        return ", ".join(f"{name} {value / GIB:.2f}" for name, value in self.parts.items() if value)


def _option(selection: Any, name: str, default: Any) -> Any:
    options = selection.options
    value = options.get(name, default) if isinstance(options, dict) else getattr(options, name, default)
    return default if value is None else value


def _hf_config(cfg: Config) -> Any:
    from skyrl_core.models import build_hf_config

    if cfg.model.config is not None:
        return build_hf_config(dict(cfg.model.config))
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(os.path.expanduser(cfg.model.path))


def _parameter_count(hf_config: Any) -> int:
    """Parameters of the model ``hf_config`` describes, counted on the meta device (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return sum(p.numel() for p in model.parameters())


def activation_bytes_per_token(hf_config: Any, *, checkpointing: bool) -> int:
    """Bytes autograd keeps per token of a micro-batch through the decoder (fp32)."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    hidden, layers = text.hidden_size, text.num_hidden_layers
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    kv = (getattr(text, "num_key_value_heads", None) or heads) * head_dim
    inter = getattr(text, "intermediate_size", None) or 4 * hidden
    experts = getattr(text, "num_experts_per_tok", None) or 1
    one_layer = (10 * hidden + 4 * inter * experts + 4 * heads * head_dim + 4 * kv) * FP32
    if checkpointing:
        return layers * hidden * FP32 + one_layer + 2 * hidden * FP32
    return layers * one_layer + 2 * hidden * FP32


# Rendering a prompt through a chat template takes about 0.1-0.5 ms: up to this many rows are
# measured (well under a second); a larger dataset is estimated at rollout.max_prompt_tokens.
MEASURED_PROMPT_ROWS = 2000


def longest_prompt_tokens(cfg: Config, rows: Sequence[dict[str, Any]]) -> int:
    """The longest prompt of ``rows`` in tokens, as rollouts start it (the row's ``prompt`` messages
    through the model's chat template, what every ``skyrl_envs`` environment's ``reset`` returns),
    capped by ``rollout.max_prompt_tokens`` (a longer prompt is refused when its row is drawn).

    The cap itself when measuring is not cheap or not possible: more than ``MEASURED_PROMPT_ROWS``
    rows, a row without a list of prompt messages (its environment builds the prompt), or a
    tokenizer that cannot render them."""
    cap = cfg.rollout.max_prompt_tokens
    prompts = [row.get("prompt") for row in rows]
    if not prompts or len(prompts) > MEASURED_PROMPT_ROWS or not all(isinstance(p, list) and p for p in prompts):
        return cap
    from skyrl_core.models import load_tokenizer
    from skyrl_core.rollout import ChatCodec

    model = cfg.model
    if model.path is not None:
        model = attrs.evolve(model, path=os.path.expanduser(model.path),
                             tokenizer=os.path.expanduser(model.tokenizer) if model.tokenizer else None)
    try:
        codec = ChatCodec(load_tokenizer(model))
        longest = max(len(codec.render_prompt(p)) for p in prompts)
    except Exception:  # noqa: BLE001 - the rollout reports a prompt it cannot render; here the cap stands in
        return cap
    return min(longest, cap)


def estimate_step_memory(cfg: Config, *, baseline_bytes: int, hf_config: Any = None,
                         parameters: int | None = None, prompt_tokens: int | None = None) -> MemoryEstimate:
    """The step's peak by part. ``prompt_tokens``: the longest prompt (``longest_prompt_tokens``);
    None takes ``rollout.max_prompt_tokens``."""
    tc, gen, ro = cfg.trainer, cfg.generation, cfg.rollout
    hf_config = hf_config if hf_config is not None else _hf_config(cfg)
    parameters = parameters if parameters is not None else _parameter_count(hf_config)
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    vocab = text.vocab_size

    prompt = ro.max_prompt_tokens if prompt_tokens is None else min(prompt_tokens, ro.max_prompt_tokens)
    response = ro.max_response_tokens if ro.max_response_tokens is not None else gen.max_new_tokens * ro.max_turns
    longest = prompt + max(response, 1)
    rows = cfg.data.prompts_per_step * gen.n_samples * (ro.max_turns if ro.stepwise else 1)
    world = int(_option(cfg.backend, "world_size", 1) or 1)
    rows_per_rank = -(-rows // world)
    micro_rows = min(rows_per_rank, tc.micro_batch_size)
    micro_tokens = micro_rows * longest
    if tc.micro_batch_tokens is not None:
        micro_tokens = max(longest, min(micro_tokens, tc.micro_batch_tokens))  # one row is never split
    rows_in_micro = max(1, micro_tokens // longest)

    use_kl = cfg.algorithm.kl.use_as != "none" and (cfg.algorithm.kl.coef > 0 or cfg.algorithm.kl.adaptive_target is not None)
    engine_bytes_per_param = 2 if cfg.model.dtype == "bfloat16" else FP32
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_bytes_per_token = text.num_hidden_layers * 2 * (getattr(text, "num_key_value_heads", None) or text.num_attention_heads) * head_dim * engine_bytes_per_param
    slots = min(cfg.data.prompts_per_step * gen.n_samples, int(_option(cfg.engine, "max_num_seqs", 64)))
    # a slot holds the request's context and its new tokens: the prompt and one turn, or, over
    # several turns, the prompt and the whole response budget (observations included)
    capacity = -(-(prompt + (response if ro.max_turns > 1 else min(gen.max_new_tokens, max(response, 1)))) // 64) * 64
    chunk = min(tc.logprob_chunk_tokens, micro_tokens)

    activations = world * micro_tokens * activation_bytes_per_token(hf_config, checkpointing=tc.activation_checkpointing)
    kv_cache = slots * capacity * kv_bytes_per_token
    kv_limit = _option(cfg.engine, "kv_cache_memory_bytes", None)
    if kv_limit is not None:  # what the engine is told to hold: skyrl-torch at most, vLLM all of it
        kv_cache = int(kv_limit)
    training = activations + world * rows_in_micro * longest * longest * FP32 + world * LOGIT_COPIES * chunk * vocab * FP32
    parts = {
        "this process now": baseline_bytes,
        "further rank processes": (world - 1) * RANK_PROCESS_BYTES,
        "trainer weights+gradients+AdamW": TRAINER_BYTES_PER_PARAMETER * parameters,
        "reference weights": FP32 * parameters if use_kl else 0,
        "engine weights": 2 * engine_bytes_per_param * parameters,
        # the phases do not overlap: rollouts hold the KV cache; training holds the largest
        # micro-batch's activations, mask and a logits chunk (and the KV cache unless the engine
        # sleeps); a weight sync holds a full fp32 copy of the weights
        "engine KV cache": kv_cache if not tc.engine_sleep else 0,
        "largest micro-batch activations+mask+logits chunk": max(training, FP32 * parameters,
                                                                 kv_cache if tc.engine_sleep else 0),
    }
    return MemoryEstimate(parts=parts, largest_micro_batch_tokens=micro_tokens)


_CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # v2
                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))  # v1


def _cgroup_limit_and_usage() -> tuple[int, int] | None:
    """This process's cgroup memory limit and what the cgroup uses now; None without a limit."""
    for limit_file, usage_file in _CGROUP_FILES:
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:
            return int(limit), usage
        return None
    return None


def machine_memory_bytes() -> int:
    """The memory this process's machine gives it in all: physical memory, or its cgroup's limit
    when smaller (a container). What a server's shares of memory (KV cache, training passes,
    adapters) are taken of."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cgroup = _cgroup_limit_and_usage()
    return min(total, cgroup[0]) if cgroup is not None else total


def usable_memory_bytes() -> int:
    """What this process may still take, plus what it holds: the smaller of the machine's
    MemAvailable and the headroom under this process's cgroup limit (v2 or v1)."""
    import psutil

    available = psutil.virtual_memory().available
    cgroup = _cgroup_limit_and_usage()
    if cgroup is not None:
        available = min(available, cgroup[0] - cgroup[1])
    return max(0, available) + psutil.Process().memory_info().rss


def check_step_memory(cfg: Config, *, usable: int | None = None,
                      train_rows: Sequence[dict[str, Any]] = ()) -> MemoryEstimate | None:
    """Refuse (``ConfigError`` on ``trainer.micro_batch_tokens``) a configuration whose estimated peak
    exceeds the memory this process may use; return the estimate otherwise (None when the model's
    config cannot be read yet: the demo model is prepared later, a missing path is refused elsewhere).
    ``train_rows``: the training data, whose longest prompt is measured (none: the cap)."""
    import psutil

    if cfg.model.config is None and not os.path.isfile(os.path.join(os.path.expanduser(cfg.model.path or ""), "config.json")):
        return None
    prompt = longest_prompt_tokens(cfg, train_rows)
    estimate = estimate_step_memory(cfg, baseline_bytes=psutil.Process().memory_info().rss, prompt_tokens=prompt)
    usable = usable_memory_bytes() if usable is None else usable
    if estimate.total <= usable:
        return estimate
    tc = cfg.trainer
    message = (
        f"the training step would need about {estimate.total / GIB:.1f} GiB but this process may use "
        f"{usable / GIB:.1f} GiB (MemAvailable / cgroup limit); estimate in GiB: {estimate.describe()}. "
        f"The largest micro-batch holds {estimate.largest_micro_batch_tokens} padded tokens (the longest "
        f"prompt, {prompt} tokens, plus the response budget). Lower it with "
        f"trainer.micro_batch_tokens (now {tc.micro_batch_tokens}) or trainer.micro_batch_size "
        f"(now {tc.micro_batch_size}), set trainer.activation_checkpointing=true (now "
        f"{str(tc.activation_checkpointing).lower()}), lower trainer.logprob_chunk_tokens (now "
        f"{tc.logprob_chunk_tokens}), rollout.max_prompt_tokens / rollout.max_response_tokens, or the "
        f"samples decoded together (data.prompts_per_step x generation.n_samples, the engine's "
        f"max_num_seqs) or the engine's KV cache (engine.options.kv_cache_memory_bytes), or set trainer.engine_sleep=true (now {str(tc.engine_sleep).lower()}); "
        f"trainer.memory_check=false skips this check"
    )
    raise ConfigError([ConfigIssue(path="trainer.micro_batch_tokens", message=message)])
