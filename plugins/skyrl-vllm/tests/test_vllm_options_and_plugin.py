"""Registration, options and the bootstrap's switches: no vLLM engine is started here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from skyrl_core.config.schema import ModelConfig
from skyrl_core.testing.engine_contract import TINY_QWEN3
from skyrl_vllm import bootstrap
from skyrl_vllm.options import OpenAIOptions, VLLMOptions


def test_registration_and_options_import_nothing_heavy():
    code = (
        "import sys, json\n"
        "from skyrl_core.plugins.manager import new_plugin_manager\n"
        "pm = new_plugin_manager()\n"
        "import skyrl_vllm.options, skyrl_vllm.plugin, skyrl_vllm.bootstrap\n"
        "reg = pm.registry\n"
        "print(json.dumps({'engines': reg.names('inference_engine'),\n"
        "  'vllm': reg.get('inference_engine', 'vllm').factory, 'openai': reg.get('inference_engine', 'openai').factory,\n"
        "  'heavy': sorted(m for m in ('torch', 'vllm', 'sglang', 'transformers') if m in sys.modules)}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"vllm", "openai"} <= set(result["engines"])
    assert result["vllm"] == "skyrl_vllm.engine:VLLMEngine"
    assert result["openai"] == "skyrl_vllm.openai_engine:OpenAIEngine"
    assert result["heavy"] == []


def test_vllm_options_defaults_and_refusals():
    opts = VLLMOptions()
    assert opts.multiprocess is True and opts.kv_cache_memory_bytes == 128 << 20 and opts.dtype is None
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, float16 or null; got 'fp8'"):
        VLLMOptions(dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_memory_bytes must be a positive integer or null; got 0"):
        VLLMOptions(kv_cache_memory_bytes=0)
    with pytest.raises(ValueError, match="engine_kwargs may not set seed, worker_extension_cls"):
        VLLMOptions(engine_kwargs={"seed": 3, "worker_extension_cls": "x.Y"})
    with pytest.raises(ValueError, match="sleep_level must be 1 .* or 2 .*, got 3"):
        VLLMOptions(sleep_level=3)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\], got 1.5"):
        VLLMOptions(gpu_memory_utilization=1.5)


def test_openai_options_need_exactly_one_server():
    with pytest.raises(ValueError, match="set exactly one of base_url .* and launch: true"):
        OpenAIOptions()
    with pytest.raises(ValueError, match="set exactly one of base_url"):
        OpenAIOptions(base_url="http://127.0.0.1:1/v1", launch=True)
    with pytest.raises(ValueError, match="base_url must start with http:// or https://, got 'localhost:8000'"):
        OpenAIOptions(base_url="localhost:8000")
    assert OpenAIOptions(launch=True).vllm == VLLMOptions()


def test_vllm_plugins_allowlist_without_skyrl_is_refused(monkeypatch):
    from skyrl_vllm.engine import VLLMEngine

    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    with pytest.raises(ValueError, match="VLLM_PLUGINS='lora_filesystem_resolver' does not include 'skyrl'"):
        VLLMEngine(ModelConfig(config=dict(TINY_QWEN3)))
    monkeypatch.setenv("VLLM_PLUGINS", "")  # vLLM reads an empty allowlist as "load nothing"
    assert bootstrap.vllm_plugins_allowlist_problem() is not None
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver, skyrl")
    assert bootstrap.vllm_plugins_allowlist_problem() is None
    monkeypatch.delenv("VLLM_PLUGINS")
    assert bootstrap.vllm_plugins_allowlist_problem() is None


BOOTSTRAP_SCRIPT = """
import json, os
from vllm.plugins import load_general_plugins
load_general_plugins()          # vLLM calls every vllm.general_plugins entry point, ours included
from skyrl_vllm import bootstrap
bootstrap.register()            # a second call in the same process must not initialise again
print(json.dumps({"pid": os.getpid(), "ran": bootstrap.ran_in_this_process()}))
"""


@pytest.mark.vllm
@pytest.mark.parametrize("marker", [None, "1"], ids=["marker_unset", "marker_set"])
def test_bootstrap_runs_through_vllm_entry_point_only_with_the_marker(tmp_path, marker):
    from vllm_test_helpers import probe_env, probe_reports, write_probe_plugin

    probe_dir = tmp_path / "reports"
    probe_dir.mkdir()
    env = {**os.environ, **probe_env(write_probe_plugin(str(tmp_path / "plugin")), str(probe_dir))}
    env.pop(bootstrap.MARKER, None)
    env.pop("VLLM_PLUGINS", None)
    if marker is not None:
        env[bootstrap.MARKER] = marker
    out = subprocess.run([sys.executable, "-c", BOOTSTRAP_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    reports = probe_reports(str(probe_dir))
    if marker is None:
        assert result["ran"] is False
        assert reports == {}
    else:
        assert result["ran"] is True
        assert reports == {result["pid"]: ["engine:vllm"]}  # once, in that process


def test_scheduling_on_cpu_splits_no_prompt_except_where_vllm_needs_chunked_prefill(tmp_path):
    """On CPU chunked prefill is off (a split seeded prompt killed vLLM-CPU's engine: the contract's
    token-budget test), except for models with recurrent layers, whose cache vLLM keeps only with
    it on; the budget is at least 4096 tokens and max_model_len either way; GPUs keep vLLM's."""
    from skyrl_vllm.engine import scheduler_kwargs

    def model_dir(name: str, config: dict) -> str:
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config))
        return str(path)

    dense = model_dir("dense", dict(TINY_QWEN3))
    hybrid = model_dir("hybrid", {**TINY_QWEN3, "model_type": "qwen3_next", "layer_types": ["linear_attention", "full_attention"]})
    options = VLLMOptions(max_model_len=8192)
    assert scheduler_kwargs(options, on_cpu=True, model_dir=dense) == {"enable_chunked_prefill": False, "max_num_batched_tokens": 8192}
    assert scheduler_kwargs(VLLMOptions(max_model_len=256), on_cpu=True, model_dir=dense)["max_num_batched_tokens"] == 4096
    assert scheduler_kwargs(options, on_cpu=True, model_dir=hybrid) == {"max_num_batched_tokens": 8192}
    assert scheduler_kwargs(VLLMOptions(max_model_len=None), on_cpu=True, model_dir=dense) == {"enable_chunked_prefill": False}
    assert scheduler_kwargs(options, on_cpu=False, model_dir=dense) == {}


@pytest.mark.parametrize("option, expected_flag", [(None, "--enforce-eager"), (True, "--enforce-eager"), (False, "--no-enforce-eager")])
def test_a_launched_vllm_serve_is_eager_on_cpu_unless_told_otherwise(tmp_path, option, expected_flag):
    """``enforce_eager: null`` means eager on CPU for ``vllm serve`` as for the in-process engine: left
    off the command line, vLLM compiled the server's model with Inductor (its start took 82 s of the
    suite, against ~30 s eager)."""
    from vllm.platforms import current_platform

    from skyrl_vllm.vllm_server import serve_command

    (tmp_path / "config.json").write_text(json.dumps(dict(TINY_QWEN3)))
    cmd = serve_command(str(tmp_path), None, VLLMOptions(enforce_eager=option), dtype="float32", seed=0, port=1)
    eager_flags = [arg for arg in cmd if arg.endswith("enforce-eager")]
    if option is None and not current_platform.is_cpu():
        assert eager_flags == ["--no-enforce-eager"]
    else:
        assert eager_flags == [expected_flag]
