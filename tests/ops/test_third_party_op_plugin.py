"""A third-party op plugin reaches every runtime: the fixture package ``skyrl-counting-linear``
(tests/fixtures) installs a ``linear`` that counts its calls and computes the runtime's default
linear. With it, the FSDP trainer, Megatron, skyrl-torch and vLLM (inside its worker processes)
call it (count > 0, in the processes that compute) and give the bits they give without it; the
negative control is the run without the plugin's switch (no count). Trainers keep the bits; the
engines' stock path is their own fused kernels, so there the logprobs are compared within 1e-4.

Each runtime runs in a fresh interpreter with the fixture on ``PYTHONPATH`` (installed with pip
into a temporary directory, not into the shared environment). vLLM's stock run, the reference, runs
in that interpreter (``multiprocess=false``); its counted run in vLLM's own worker processes.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "skyrl-counting-linear"

SCRIPT = r"""
import json, os, sys
import torch
from skyrl_core.config.loader import structure_options
from skyrl_core.config.schema import ModelConfig, TrainerConfig
from skyrl_core.plugins.manager import get_plugin_manager
from skyrl_core.testing.engine_contract import TINY_QWEN3, request
from skyrl_core.types import TrainingBatch

def main():
    kind, name, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    stock_options = {**options, **json.loads(sys.argv[5])}  # the run without the plugin's switch
    torch.manual_seed(0)
    model = ModelConfig(config=dict(TINY_QWEN3))
    spec = get_plugin_manager().spec(kind, name)
    assert any(row.name == "counting-linear" and row.status == "ok" for row in get_plugin_manager().listing()), "fixture plugin not loaded"

    def run(counting):
        if counting:
            os.environ["SKYRL_COUNTING_LINEAR_DIR"] = sys.argv[4]
        else:
            os.environ.pop("SKYRL_COUNTING_LINEAR_DIR", None)
        kwargs = {"trainer": TrainerConfig(micro_batch_size=2)} if kind == "training_backend" else {}
        given = options if counting else stock_options
        runtime = spec.load_factory()(model, structure_options(spec, given, path=name), seed=0, **kwargs)
        try:
            declared = runtime.execution_contract().get("ledger", {}).get("linear@" + ("trainer_forward" if kind == "training_backend" else "engine_decode"), {})
            if kind == "training_backend":
                ids = torch.tensor([[0, 5, 9, 17, 3, 8], [4, 11, 2, 7, 30, 12]])
                batch = TrainingBatch(input_ids=ids, attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1], [1] * 6]),
                                      loss_mask=torch.ones(2, 3))
                out = runtime.forward(batch).float().flatten().tolist()
            else:
                groups = runtime.generate([request([5, 9, 17, 3], "a", max_tokens=6, seed=1, temperature=1.0),
                                           request([4, 11, 2], "b", max_tokens=6, seed=2, temperature=1.0)])
                out = [x for g in groups for s in g for x in s.logprobs]
                tokens.append([list(s.token_ids) for g in groups for s in g])
        finally:
            runtime.close()
        return out, declared.get("impl")

    tokens = []
    stock, stock_impl = run(False)
    counted, counted_impl = run(True)
    a, b = torch.tensor(stock, dtype=torch.float32), torch.tensor(counted, dtype=torch.float32)
    print(json.dumps({"same_bits": bool(torch.equal(a.view(torch.int32), b.view(torch.int32))), "same_tokens": tokens[:1] == tokens[1:],
                      "max_abs_diff": float((a.double() - b.double()).abs().max()) if a.shape == b.shape else None,
                      "stock_impl": stock_impl, "counted_impl": counted_impl, "pid": os.getpid()}))


if __name__ == "__main__":  # vLLM spawns processes that import this file
    main()
"""


@pytest.fixture(scope="module")
def counting_plugin_path(tmp_path_factory) -> str:
    target = tmp_path_factory.mktemp("counting-linear-site")
    subprocess.run(
        [sys.executable, "-m", "pip", "-q", "install", "--no-deps", "--no-build-isolation", "--target", str(target), str(FIXTURE)],
        check=True, capture_output=True, timeout=300,
    )
    return str(target)


def _run(counting_plugin_path: str, tmp_path, kind: str, name: str, options: dict,
         stock_options: dict | None = None) -> tuple[dict, dict[int, int]]:
    """The SCRIPT's result and each process's count of the plugin's calls; ``stock_options`` (over
    ``options``) are for the stock run only."""
    counts = tmp_path / "counts"
    counts.mkdir()
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([counting_plugin_path, os.environ.get("PYTHONPATH", "")])}
    env.pop("SKYRL_COUNTING_LINEAR_DIR", None)
    out = subprocess.run([sys.executable, str(script), kind, name, json.dumps(options), str(counts),
                          json.dumps(stock_options or {})],
                         capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(kind, name, result)
    calls = {}
    for path in counts.glob("*.json"):
        row = json.loads(path.read_text())
        calls[row["pid"]] = row["calls"]
    return result, calls


def _check(result: dict, calls: dict[int, int], stock_impl: str, counted_impl: str) -> None:
    assert (result["stock_impl"], result["counted_impl"]) == (stock_impl, counted_impl)
    assert calls and all(n > 0 for n in calls.values()), calls
    assert result["same_bits"] is True


def _check_engine(result: dict, calls: dict[int, int]) -> None:
    """Engines run their own fused stock kernels (q/k/v in one GEMM, prepacked weights) when
    nothing is installed; routed through the op they run one ``F.linear`` per projection, as the
    trainer does, so the logprobs stay close, not bitwise equal."""
    assert (result["stock_impl"], result["counted_impl"]) == ("torch.linear", "counting.linear")
    assert calls and all(n > 0 for n in calls.values()), calls
    assert result["same_tokens"] is True
    assert result["max_abs_diff"] is not None and result["max_abs_diff"] < 1e-4, result


@pytest.mark.slow
def test_fsdp_trainer_calls_a_third_party_linear(counting_plugin_path, tmp_path):
    from skyrl_core.ops.gemm_choice import faster_fp32_gemm

    result, calls = _run(counting_plugin_path, tmp_path, "training_backend", "fsdp", {"world_size": 1, "device": "cpu"})
    # FSDP's default on CPU fp32 (cpu_gemm: auto) is the library this machine measured faster, kept in
    # the cache file the script's interpreter reads too; the plugin wraps whichever it is.
    expected = {"onednn": ("onednn.linear", "counting.onednn_linear"), "torch": ("torch.linear", "counting.linear")}
    _check(result, calls, *expected[faster_fp32_gemm()])
    assert list(calls) == [result["pid"]]


@pytest.mark.slow
def test_megatron_trainer_calls_a_third_party_linear(counting_plugin_path, tmp_path):
    result, calls = _run(counting_plugin_path, tmp_path, "training_backend", "megatron",
                         {"tensor_parallel": 1, "world_size": 1, "device": "cpu"})
    _check(result, calls, "torch.linear", "counting.linear")


def test_skyrl_torch_engine_calls_a_third_party_linear(counting_plugin_path, tmp_path):
    result, calls = _run(counting_plugin_path, tmp_path, "inference_engine", "torch", {})
    _check_engine(result, calls)
    assert list(calls) == [result["pid"]]


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_worker_processes_call_a_third_party_linear(counting_plugin_path, tmp_path):
    # The stock run (the reference logprobs and tokens) in the driver's process: stock vLLM's numerics
    # do not depend on where its worker runs, and it saves the engine core's and worker's start-ups.
    result, calls = _run(counting_plugin_path, tmp_path, "inference_engine", "vllm",
                         {"kv_cache_memory_bytes": 32 << 20, "max_model_len": 256}, {"multiprocess": False})
    _check_engine(result, calls)
    # Counted in vLLM's worker process, not in the driver: skyrl-vllm routed the worker's layers.
    assert result["pid"] not in calls
