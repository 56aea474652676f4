"""What IsoExec cannot make identical inside vLLM is refused with one sentence, before any vLLM
process starts (vLLM's config is checked in the front-end); with IsoExec off the same settings pass."""

from __future__ import annotations

import os

import pytest
import torch

from skyrl_core.config.schema import ModelConfig
from skyrl_isoexec import state
from skyrl_isoexec.presets import preset

pytest.importorskip("vllm")

BAD = {
    "logprobs_mode": ({"logprobs_mode": "processed_logprobs"}, "logprobs_mode='processed_logprobs' returns values other than"),
    "quantization": ({"quantization": "fp8"}, "quantization='fp8' replaces the GEMMs by quantized kernels"),
    "kv_cache_dtype": ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype='fp8' stores keys and values in another dtype"),
    "compiled": ({"enforce_eager": False}, "lets torch.compile fuse the canonical ops"),
    "float16": ({"dtype": "float16"}, "dtype='float16' has no canonical kernels"),
    "tensor_parallel": ({"tensor_parallel_size": 2}, "split GEMM reductions across ranks"),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from skyrl_core.engines.model_dir import materialize_model

    root = str(tmp_path_factory.mktemp("models"))
    qwen3 = materialize_model(ModelConfig(config=preset("qwen3")), parent_dir=root)
    mistral_config = {**preset("llama"), "model_type": "mistral", "sliding_window": None}
    mistral = materialize_model(ModelConfig(config=mistral_config), parent_dir=root)
    return {"qwen3": qwen3, "mistral": mistral}


@pytest.fixture(scope="module", autouse=True)
def installed():
    """What skyrl's vLLM bootstrap does in a vLLM process: install IsoExec's replacements."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import vllm  # noqa: F401  (worker_init acts only where vLLM is loaded)

    from skyrl_isoexec.vllm import worker_init

    with state.enabled_scope(True):
        assert worker_init("engine")


def _create_config(model_dir: tuple[str, str], **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    args = {"model": model_dir[0], "tokenizer": model_dir[1], "enforce_eager": True,
            "kv_cache_memory_bytes": 32 << 20, "max_model_len": 256, **kwargs}
    return EngineArgs(**args).create_engine_config()


@pytest.mark.parametrize("case", sorted(BAD))
def test_each_unsupported_setting_is_refused_with_its_reason(model_dirs, case):
    from skyrl_isoexec.vllm.checks import IsoExecRefusal

    kwargs, reason = BAD[case]
    with state.enabled_scope(True), pytest.raises(IsoExecRefusal) as refused:
        _create_config(model_dirs["qwen3"], **kwargs)
    assert str(refused.value).startswith("IsoExec cannot make vLLM bitwise identical to the trainer: ")
    assert reason in str(refused.value) and len(refused.value.problems) == 1
    if case in ("logprobs_mode", "compiled", "kv_cache_dtype"):  # vLLM itself accepts these: the refusal is ours
        with state.enabled_scope(False):
            _create_config(model_dirs["qwen3"], **kwargs)


def test_an_architecture_without_canonical_ops_is_refused(model_dirs):
    from skyrl_isoexec.vllm.checks import IsoExecRefusal

    with state.enabled_scope(True):
        _create_config(model_dirs["qwen3"])  # supported: accepted
        with pytest.raises(IsoExecRefusal, match="architecture MistralForCausalLM has no canonical ops inside vLLM"):
            _create_config(model_dirs["mistral"])
    with state.enabled_scope(False):
        _create_config(model_dirs["mistral"])


def test_a_plugin_allowlist_without_skyrls_bootstrap_is_refused(model_dirs, monkeypatch):
    from skyrl_isoexec.vllm.checks import IsoExecRefusal, allowlist_problem

    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    assert "excludes skyrl's vLLM bootstrap (skyrl)" in allowlist_problem()
    with state.enabled_scope(True), pytest.raises(IsoExecRefusal, match="VLLM_PLUGINS='lora_filesystem_resolver'"):
        _create_config(model_dirs["qwen3"])
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver,skyrl")
    assert allowlist_problem() is None


def test_the_vllm_engine_refuses_before_starting_its_processes(monkeypatch, tmp_path):
    from skyrl_isoexec.vllm.checks import IsoExecRefusal
    from skyrl_vllm.engine import VLLMEngine
    from skyrl_vllm.options import VLLMOptions

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    options = VLLMOptions(kv_cache_memory_bytes=32 << 20, enforce_eager=False, multiprocess=True)
    with state.enabled_scope(True), pytest.raises(IsoExecRefusal, match="use enforce_eager=True"):
        VLLMEngine(ModelConfig(config=preset("qwen3")), options, seed=0)


def test_model_inspection_names_modules_without_a_canonical_op():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm

    from skyrl_core.ops import prepare_model
    from skyrl_core.ops.engine_layers import route_model
    from skyrl_isoexec.vllm.checks import IsoExecRefusal, inspect_model, routed_ledger
    from skyrl_vllm.op_sites import layer_classes, routed_ops

    with set_current_vllm_config(VllmConfig()):
        model = torch.nn.Module()
        model.act = SiluAndMul()
        model.partial = RMSNorm(8, var_hidden_size=4)  # a norm over part of the hidden size: no canonical op
    with pytest.raises(IsoExecRefusal, match="op sites did not route Module's layers"):
        routed_ledger(model)  # not routed yet (skyrl-vllm's op sites off)
    with state.enabled_scope(True):
        ledger = prepare_model(None, "engine")
    route_model(model, ledger, routed_ops(ledger), layer_classes())  # what skyrl-vllm's op sites do at load
    assert routed_ledger(model) is ledger
    with set_current_vllm_config(VllmConfig()):
        model.norm = RMSNorm(8)  # built after routing (a rival's swap, say): vLLM's own forward
    model.proj = torch.nn.Linear(8, 8)
    op_modules, patched, unpatched = inspect_model(model, ledger.meta)
    assert op_modules == {"silu_mul": 1} and patched == ["act"]
    assert unpatched == ["partial (RMSNorm)", "norm (RMSNorm)", "proj (Linear)"]
