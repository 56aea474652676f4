"""The step's peak memory is estimated before any work; over what the process may use, the run is
refused naming trainer.micro_batch_tokens and the other knobs. A failing step names its phase."""

from __future__ import annotations

import contextlib
import os

import pytest

from skyrl_core.config.errors import ConfigError
from skyrl_core.config.loader import structure_config
from skyrl_core.testing.backend_contract import TINY_QWEN3
from skyrl_core.trainer.failure import RunActivity, StepFailedError
from skyrl_core.trainer.memory_estimate import (
    GIB,
    activation_bytes_per_token,
    check_step_memory,
    estimate_step_memory,
    usable_memory_bytes,
)
from skyrl_core.trainer.rl import train
from tests.trainer.test_preflight import _config

SMOLLM2_LIKE = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
                "tie_word_embeddings": True}


def _cfg(tmp_path, model=None, **trainer):
    raw = _config(tmp_path, trainer=trainer, rollout={"max_prompt_tokens": 1024, "max_response_tokens": 512},
                  generation={"n_samples": 4, "max_new_tokens": 64})
    raw["model"] = {"config": model or SMOLLM2_LIKE}
    return structure_config(raw)


def _estimate(cfg, **kw):
    return estimate_step_memory(cfg, baseline_bytes=0, parameters=kw.pop("parameters", 135_000_000), **kw)


def test_activations_grow_linearly_in_micro_batch_tokens_and_checkpointing_lowers_them(tmp_path):
    # 8 rows of 1536 tokens: budgets of 1, 2 and 4 rows
    parts = [_estimate(_cfg(tmp_path, micro_batch_tokens=t)).parts for t in (1536, 3072, 6144)]
    key = "largest micro-batch activations+mask+logits chunk"
    steps = [parts[1][key] - parts[0][key], parts[2][key] - parts[1][key]]
    assert steps[1] == 2 * steps[0] > 0  # linear: twice the tokens, twice the increase
    assert all(p["trainer weights+gradients+AdamW"] == 26 * 135_000_000 for p in parts)
    full = activation_bytes_per_token(_hf(SMOLLM2_LIKE), checkpointing=False)
    ckpt = activation_bytes_per_token(_hf(SMOLLM2_LIKE), checkpointing=True)
    assert 1.4e6 < full < 2.0e6 and ckpt < full / 8  # ~1.7 MB vs ~0.13 MB per token (SmolLM2, measured 1.6)


def _hf(config):
    from skyrl_core.models import build_hf_config

    return build_hf_config(dict(config))


def test_vocabulary_enters_only_through_one_logits_chunk(tmp_path):
    small = _estimate(_cfg(tmp_path, model={**SMOLLM2_LIKE, "vocab_size": 32_000}))
    large = _estimate(_cfg(tmp_path, model={**SMOLLM2_LIKE, "vocab_size": 128_000}))
    key = "largest micro-batch activations+mask+logits chunk"
    chunk = _cfg(tmp_path).trainer.logprob_chunk_tokens
    assert large.parts[key] - small.parts[key] == 6 * chunk * (128_000 - 32_000) * 4


def test_an_absurd_budget_is_refused_before_any_work_naming_the_knobs(tmp_path):
    raw = _config(tmp_path, trainer={"micro_batch_tokens": 10**9, "micro_batch_size": 10**6},
                  rollout={"max_prompt_tokens": 10**6, "max_response_tokens": 10**5})
    raw["model"] = {"config": dict(TINY_QWEN3)}
    cfg = structure_config(raw)
    with pytest.raises(ConfigError) as caught:
        train(cfg)
    text = str(caught.value)
    assert "trainer.micro_batch_tokens" in text and "GiB" in text
    for knob in ("trainer.activation_checkpointing", "trainer.micro_batch_size", "trainer.logprob_chunk_tokens",
                 "rollout.max_prompt_tokens", "trainer.memory_check=false"):
        assert knob in text
    assert not os.path.exists(cfg.trainer.output_dir)  # nothing written, nothing loaded
    # negative control: the same config fits when the machine is said to be large enough
    assert check_step_memory(cfg, usable=10**18) is not None


def test_the_estimate_takes_the_datas_longest_prompt_not_the_cap(tmp_path):
    """The tiny model's byte tokenizer renders a prompt as its template's bytes: rows of 10 and 300
    characters give a longest prompt of a few hundred tokens, under the 1024-token cap; the
    micro-batch (one row: prompt + the 512-token response budget) and the KV cache follow it."""
    from skyrl_core.config.schema import ModelConfig
    from skyrl_core.models import load_tokenizer
    from skyrl_core.rollout import ChatCodec
    from skyrl_core.trainer import memory_estimate

    raw = _config(tmp_path, trainer={"micro_batch_size": 1},
                  rollout={"max_prompt_tokens": 1024, "max_response_tokens": 512})
    cfg = structure_config(raw)
    rows = [{"prompt": [{"role": "user", "content": "x" * n}]} for n in (10, 300, 40)]
    codec = ChatCodec(load_tokenizer(ModelConfig(config=dict(cfg.model.config))))
    expected = len(codec.render_prompt(rows[1]["prompt"]))
    assert 300 <= expected < 1024
    assert memory_estimate.longest_prompt_tokens(cfg, rows) == expected
    measured = _estimate(cfg, prompt_tokens=expected)
    capped = _estimate(cfg)
    assert measured.largest_micro_batch_tokens == expected + 512 and capped.largest_micro_batch_tokens == 1024 + 512
    assert measured.parts["engine KV cache"] < capped.parts["engine KV cache"]
    # the cap stands in when a prompt is longer, a row has no prompt messages, or rows are too many to render
    long_rows = [*rows, {"prompt": [{"role": "user", "content": "y" * 5000}]}]
    assert memory_estimate.longest_prompt_tokens(cfg, long_rows) == 1024
    assert memory_estimate.longest_prompt_tokens(cfg, [*rows, {"question": "no messages"}]) == 1024
    assert memory_estimate.longest_prompt_tokens(cfg, rows * (memory_estimate.MEASURED_PROMPT_ROWS // 3 + 1)) == 1024
    # the refusal says which prompt length it took, and still names the knobs
    with pytest.raises(ConfigError) as caught:
        check_step_memory(cfg, usable=1, train_rows=rows)
    assert f"the longest prompt, {expected} tokens" in str(caught.value)
    assert "trainer.micro_batch_tokens" in str(caught.value) and "rollout.max_prompt_tokens" in str(caught.value)


def test_a_small_run_fits_and_the_usable_memory_is_read():
    usable = usable_memory_bytes()
    assert 0.25 * GIB < usable < 2**50


def test_a_failing_step_names_its_step_and_phase(tmp_path):
    activity = RunActivity(str(tmp_path / "metrics.jsonl"))
    with pytest.raises(StepFailedError) as caught:
        with contextlib.ExitStack() as stack:
            stack.push(activity.on_exit)
            activity.now(3, "training (forward_backward and optimizer steps)")
            raise MemoryError("cannot allocate 4 GB")
    message = str(caught.value)
    assert message.startswith("step 3 failed while training (forward_backward and optimizer steps): MemoryError")
    assert str(tmp_path / "metrics.jsonl") in message and isinstance(caught.value.__cause__, MemoryError)
    # config errors pass through as they are
    with pytest.raises(ConfigError):
        with contextlib.ExitStack() as stack:
            stack.push(activity.on_exit)
            raise ConfigError([])


@pytest.mark.slow
def test_a_run_with_every_memory_option_trains_and_a_failing_step_says_where(tmp_path, fresh_plugin_manager, monkeypatch):
    """One tiny step with one-row micro-batches (a 16-token budget), activation checkpointing,
    64-position logits chunks and the engine asleep while training; then the same run failing in
    forward_backward stops with the step and phase, the metrics of step 0 (eval) on disk."""
    from skyrl_core.config.loader import load_config
    from skyrl_core.trainer.metrics import read_metrics
    from skyrl_fsdp.backend import FSDPBackend
    from tests.e2e.tiny_run import write_tiny_config
    from tests.rollout.envs import TestEnvironments

    fresh_plugin_manager.register_plugin(TestEnvironments(), "test-envs")
    from skyrl_core import heap

    options = dict(steps=1, micro_batch_tokens=16, activation_checkpointing=True, logprob_chunk_tokens=64,
                   engine_sleep=True, heap_mmap_threshold_mib=4)
    config = write_tiny_config(tmp_path, **options)
    cfg = load_config(str(config), plugin_manager=fresh_plugin_manager)
    monkeypatch.delenv("SKYRL_HEAP_MMAP_MIB", raising=False)  # restored after the test, as is the threshold
    try:
        result = train(cfg, plugin_manager=fresh_plugin_manager)
        assert os.environ["SKYRL_HEAP_MMAP_MIB"] == "4"  # what rank processes started now adopt
    finally:
        heap.set_mmap_threshold(heap.MMAP_THRESHOLD >> 20)
    trained = [r for r in result.history if r["step"] == 1][0]
    assert "loss" in trained and "grad_norm" in trained and "eval/accuracy" in trained  # eval ran after a wake

    def out_of_memory(self, batch, loss_fn, temperature=1.0):
        raise MemoryError("cannot allocate")

    monkeypatch.setattr(FSDPBackend, "forward_backward", out_of_memory)
    config = write_tiny_config(tmp_path / "failing", **options)
    cfg = load_config(str(config), plugin_manager=fresh_plugin_manager)
    with pytest.raises(StepFailedError, match=r"^step 1 failed while training .*MemoryError: cannot allocate"):
        train(cfg, plugin_manager=fresh_plugin_manager)
    assert [r["step"] for r in read_metrics(cfg.trainer.output_dir)] == [0]


def test_an_engine_kv_budget_stands_in_for_the_cache_it_bounds(tmp_path):
    # slots x (prompt + response budget) positions at 46 KiB each (SmolLM2-like); an engine told to
    # hold 256 MiB holds that (skyrl-torch at most, vLLM exactly), and the estimate says so
    raw = _config(tmp_path, rollout={"max_prompt_tokens": 1024, "max_response_tokens": 512},
                  generation={"n_samples": 4, "max_new_tokens": 64})
    raw["model"] = {"config": SMOLLM2_LIKE}
    unbounded = _estimate(structure_config(raw)).parts["engine KV cache"]
    raw["engine"] = {"name": "torch", "options": {"kv_cache_memory_bytes": 256 << 20}}
    bounded = _estimate(structure_config(raw)).parts["engine KV cache"]
    assert bounded == 256 << 20 < unbounded


def test_the_machines_memory_is_its_cgroups_limit_in_a_container(tmp_path, monkeypatch):
    from skyrl_core.trainer import memory_estimate

    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit, usage = tmp_path / "memory.max", tmp_path / "memory.current"
    usage.write_text("1000\n")
    monkeypatch.setattr(memory_estimate, "_CGROUP_FILES", ((str(limit), str(usage)),))
    limit.write_text("max\n")  # no limit
    assert memory_estimate.machine_memory_bytes() == physical
    limit.write_text(f"{physical // 8}\n")
    assert memory_estimate.machine_memory_bytes() == physical // 8
    assert memory_estimate._cgroup_limit_and_usage() == (physical // 8, 1000)
