"""skyrl sft: chat rendering and loss masks, packed rows scored as if alone, exact resume after a
kill, the exported directory, and (SmolLM2, slow: examples/sft.yaml through ``skyrl sft``) eval loss
that falls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch
import yaml

from skyrl_core.byte_tokenizer import ByteTokenizer
from skyrl_core.config.errors import ConfigError
from skyrl_core.config.loader import load_config
from skyrl_core.config.schema import ModelConfig, TrainerConfig
from skyrl_core.data import DatasetError, write_jsonl
from skyrl_core.data_chat import load_chat_dataset, render_chat
from skyrl_core.testing.backend_contract import TINY_QWEN3
from skyrl_core.trainer.metrics import read_metrics, without_timings
from skyrl_core.trainer.sft import HF_DIR, build_sft_batch, sample_logprobs, sft, token_mean_weights
from skyrl_core.models import SMOLLM2_DIR
from tests.e2e.example_run import check_example_run

ROOT = Path(__file__).resolve().parents[2]
SFT_DATA = ROOT / "examples" / "data" / "sft"
TOK = ByteTokenizer(vocab_size=512)


def _conversations(count: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"add {k} and {k + 1}"}, {"role": "assistant", "content": f"{2 * k + 1}"},
             {"role": "user", "content": "again" * (k % 3)}, {"role": "assistant", "content": f"sum {2 * k + 1}!"}]
            for k in range(count)]


def test_the_loss_mask_covers_exactly_the_assistant_turns():
    conv = _conversations(3)[2]
    every = render_chat(TOK, conv, "all_assistant")
    last = render_chat(TOK, conv, "last_assistant")
    assert every.input_ids == last.input_ids == tuple(TOK.apply_chat_template(conv))
    trained = lambda s: TOK.decode([t for t, m in zip(s.input_ids, s.loss_mask) if m])  # noqa: E731
    # the byte template: "<|role|>\n{content}\n"; an assistant turn's tokens are its content and newline
    assert trained(every) == "5\nsum 5!\n" and trained(last) == "sum 5!\n"
    assert sum(every.loss_mask) == len("5\nsum 5!\n")


def test_a_saved_byte_tokenizer_is_what_a_later_run_loads(tmp_path):
    from skyrl_core.models import load_tokenizer

    assert ByteTokenizer.from_directory(str(tmp_path)) is None  # nothing saved: not taken for one
    ByteTokenizer(vocab_size=300).save_pretrained(str(tmp_path))
    loaded = load_tokenizer(ModelConfig(path=str(tmp_path)))
    assert isinstance(loaded, ByteTokenizer) and loaded.vocab_size == 300


def test_chat_datasets_are_checked(tmp_path):
    write_jsonl([{"messages": [{"role": "user", "content": "hi"}]}], tmp_path / "a.jsonl")
    with pytest.raises(DatasetError, match="row 0 has no assistant message"):
        load_chat_dataset(tmp_path / "a.jsonl")
    write_jsonl([{"messages": [{"role": "robot", "content": "hi"}]}], tmp_path / "b.jsonl")
    with pytest.raises(DatasetError, match="message 0 must be"):
        load_chat_dataset(tmp_path / "b.jsonl")
    rows = load_chat_dataset(SFT_DATA / "train.jsonl")
    assert len(rows) == 96 and rows[0]["messages"][-1]["role"] == "assistant"


def test_packed_rows_score_every_conversation_as_if_alone():
    from skyrl_fsdp.backend import FSDPBackend
    from skyrl_fsdp.options import FSDPOptions

    samples = [render_chat(TOK, c) for c in _conversations(7)]
    with FSDPBackend(ModelConfig(config=dict(TINY_QWEN3)), FSDPOptions(device="cpu"),
                     trainer=TrainerConfig(micro_batch_size=3)) as backend:
        packed, packed_rows = build_sft_batch(samples, 0, pack=True, max_length=220)
        plain, plain_rows = build_sft_batch(samples, 0, pack=False, max_length=220)
        assert len(packed) < len(plain) and max(map(len, packed_rows)) >= 3
        mine = sample_logprobs(backend.forward(packed), samples, packed_rows)
        alone = sample_logprobs(backend.forward(plain), samples, plain_rows)
        gap = max((a - b).abs().max().item() for a, b in zip(mine, alone))
        assert gap < 1e-5, gap
        # negative control: the same packed rows without position ids attend across conversations
        leaky = sample_logprobs(backend.forward(attrs.evolve(packed, position_ids=None)), samples, packed_rows)
        assert max((a - b).abs().max().item() for a, b in zip(leaky, alone)) > 1e-3
        # the training loss (token-mean NLL of the assistant tokens) is the same both ways
        losses = [backend.forward_backward(token_mean_weights(b), _nll())["loss"] for b in (packed, plain)]
        assert abs(losses[0] - losses[1]) < 1e-5 and losses[0] > 1.0, losses


def _nll():
    from skyrl_core.algorithms.policy_losses import make_cross_entropy
    from skyrl_core.trainer.loss import RLLoss

    return RLLoss(policy_loss=make_cross_entropy())


def _tiny_config(tmp_path: Path, out: str, **trainer) -> Path:
    write_jsonl([{"messages": c} for c in _conversations(24)], tmp_path / "train.jsonl")
    write_jsonl([{"messages": c} for c in _conversations(30)[24:]], tmp_path / "eval.jsonl")
    config = {
        "model": {"config": dict(TINY_QWEN3)},
        "data": {"train": str(tmp_path / "train.jsonl"), "eval": str(tmp_path / "eval.jsonl")},
        "trainer": {"steps": 4, "lr": 3e-3, "micro_batch_size": 4, "checkpoint_every": 2, "eval_every": 2,
                    "progress": False, "output_dir": str(tmp_path / out), **trainer},
        "sft": {"batch_size": 6, "max_length": 160},
    }
    path = tmp_path / f"{out}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


KILL_AT_CHECKPOINT = """
import os, signal, sys
from skyrl_core.cli.main import cli
from skyrl_core.plugins import hookimpl
from skyrl_core.plugins.manager import get_plugin_manager

class Kill:
    @hookimpl
    def skyrl_on_checkpoint(self, step, path):
        if step == 2:
            os.kill(os.getpid(), signal.SIGKILL)

get_plugin_manager().register_plugin(Kill(), "kill")
cli.main(["sft", *sys.argv[1:]], prog_name="skyrl")
"""


@pytest.mark.slow
def test_sft_resumes_exactly_after_a_kill_and_exports_a_transformers_model(tmp_path, fresh_plugin_manager):
    whole = sft(load_config(str(_tiny_config(tmp_path, "whole")), plugin_manager=fresh_plugin_manager),
                plugin_manager=fresh_plugin_manager)
    records = [without_timings(r) for r in whole.history]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert records[4]["eval/loss"] < records[0]["eval/loss"] - 0.5, records  # it learns
    assert {"loss", "grad_norm", "lr", "tokens", "rows"} <= set(records[1])

    config = _tiny_config(tmp_path, "killed")
    killed = subprocess.run([sys.executable, "-c", KILL_AT_CHECKPOINT, str(config)], cwd=ROOT, capture_output=True,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert [r["step"] for r in read_metrics(str(tmp_path / "killed"))] == [0, 1, 2]
    resumed = sft(load_config(str(config), [f"trainer.resume={tmp_path / 'killed'}"], plugin_manager=fresh_plugin_manager),
                  plugin_manager=fresh_plugin_manager)
    assert [without_timings(r) for r in resumed.history] == records
    assert [without_timings(r) for r in read_metrics(resumed.run_dir)] == records

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(whole.hf_dir, dtype=torch.float32)
    assert isinstance(ByteTokenizer.from_directory(whole.hf_dir), ByteTokenizer)  # a later run's model.path
    # the architecture is recorded (vLLM took a config-built model's export without it for a pooling model)
    assert json.loads((Path(whole.hf_dir) / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    prompt = torch.tensor([TOK.apply_chat_template(_conversations(1)[0][:1], add_generation_prompt=True)])
    out = model.generate(prompt, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, prompt.shape[1] + 4)
    assert (Path(whole.run_dir) / "metrics.png").stat().st_size > 1000


def test_bad_sft_inputs_are_refused_before_any_work(tmp_path, fresh_plugin_manager):
    config = _tiny_config(tmp_path, "bad")
    with pytest.raises(ConfigError) as info:
        sft(load_config(str(config), ["sft.max_length=20", "data.eval=nowhere.jsonl"], plugin_manager=fresh_plugin_manager),
            plugin_manager=fresh_plugin_manager)
    text = str(info.value)
    assert "more than sft.max_length=20" in text and "data.eval: dataset file" in text
    assert not (tmp_path / "bad").exists()
    with pytest.raises(ConfigError, match="sft.loss_on"):
        load_config(str(config), ["sft.loss_on=first"], plugin_manager=fresh_plugin_manager)


@pytest.mark.slow
def test_sft_on_smollm2_lowers_eval_loss_and_exports_a_model_that_generates(tmp_path):
    # The shipped examples/sft.yaml through `skyrl sft` from another directory, checked as
    # tests/e2e/test_examples.py checks every example (exit 0, last step logged, no warning noise):
    # this is that example's run, so SmolLM2 is loaded for SFT once in the suite, not twice.
    if not Path(os.path.expanduser(SMOLLM2_DIR), "config.json").is_file():
        from skyrl_core.models import prepare_smollm2

        prepare_smollm2(os.path.expanduser(SMOLLM2_DIR))
    check_example_run(ROOT / "examples" / "sft.yaml", tmp_path, "trainer.eval_every=6", "data.eval_size=8", steps=6)
    history = read_metrics(str(tmp_path / "run"))
    evals = [r["eval/loss"] for r in history if "eval/loss" in r]
    assert len(evals) == 2 and evals[1] < evals[0] - 0.1, evals
    hf_dir = str(tmp_path / "run" / HF_DIR)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    messages = load_chat_dataset(SFT_DATA / "eval.jsonl")[0]["messages"][:2]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    text = tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert " + " in text and " = " in text, text  # the trained reply format
    json.dumps(history)  # metrics are plain JSON

    # packed and unpacked batches of the same real conversations: the same fp32 loss
    from skyrl_fsdp.backend import FSDPBackend
    from skyrl_fsdp.options import FSDPOptions

    samples = [render_chat(tokenizer, row["messages"]) for row in load_chat_dataset(SFT_DATA / "eval.jsonl")[:6]]
    with FSDPBackend(ModelConfig(path=hf_dir), FSDPOptions(device="cpu"),
                     trainer=TrainerConfig(micro_batch_size=6)) as backend:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        (packed, rows), (plain, _) = (build_sft_batch(samples, pad, pack=p, max_length=1024) for p in (True, False))
        assert len(packed) < len(plain) and max(map(len, rows)) >= 2
        losses = [backend.forward_backward(token_mean_weights(b), _nll())["loss"] for b in (packed, plain)]
    assert abs(losses[0] - losses[1]) < 1e-5 and losses[0] > 0.01, losses
