"""skyrl-sglang on a machine without CUDA: registration, options, mapping, bootstrap, the refusal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from skyrl_core.config.schema import ModelConfig
from skyrl_core.testing.engine_contract import TINY_QWEN3
from skyrl_core.types import GenerationRequest, SamplingParams
from skyrl_sglang import bootstrap
from skyrl_sglang.mapping import derive_seed, flatten, gather, sglang_sampling_params
from skyrl_sglang.options import SGLangOptions


def test_registration_and_options_import_nothing_heavy():
    code = (
        "import sys, json\n"
        "from skyrl_core.plugins.manager import new_plugin_manager\n"
        "spec = new_plugin_manager().registry.get('inference_engine', 'sglang')\n"
        "spec.load_options_class()\n"
        "import skyrl_sglang.bootstrap\n"
        "print(json.dumps({'factory': spec.factory, 'heavy': sorted(m for m in ('torch', 'sglang', 'vllm') if m in sys.modules)}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"factory": "skyrl_sglang.engine:SGLangEngine", "heavy": []}


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_the_engine_stops_with_one_clear_sentence():
    from skyrl_sglang.engine import EngineUnavailableError, SGLangEngine

    with pytest.raises(EngineUnavailableError) as info:
        SGLangEngine(ModelConfig(config=dict(TINY_QWEN3)), SGLangOptions())
    assert str(info.value) == (
        "The sglang engine needs an NVIDIA GPU with CUDA and this machine has none; "
        "use engine.name=vllm or engine.name=torch here."
    )


def test_options_refusals():
    assert SGLangOptions().deterministic is True
    with pytest.raises(ValueError, match=r"mem_fraction_static must be in \(0, 1\), got 1.2"):
        SGLangOptions(mem_fraction_static=1.2)
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, float16 or null; got 'int8'"):
        SGLangOptions(dtype="int8")
    with pytest.raises(ValueError, match="engine_kwargs may not set model_path, random_seed"):
        SGLangOptions(engine_kwargs={"model_path": "x", "random_seed": 1})


def _req(rid, prompt, **sampling):
    return GenerationRequest(request_id=rid, prompt_token_ids=prompt, sampling=SamplingParams(**sampling))


def test_sampling_params_map_one_to_one():
    s = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.8, top_k=0, seed=4, stop=("x",), stop_token_ids=(2,))
    assert sglang_sampling_params(s, 1) == {
        "max_new_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.8,
        "top_k": -1,  # skyrl's 0 ("off") is SGLang's -1
        "n": 1,
        "skip_special_tokens": True,
        "stop": ["x"],
        "stop_token_ids": [2],
        "sampling_seed": derive_seed(4, 1),
    }
    assert sglang_sampling_params(SamplingParams(top_k=5), 0)["top_k"] == 5
    assert "sampling_seed" not in sglang_sampling_params(SamplingParams(), 0)


def test_samples_are_flattened_per_sample_and_seeded_independently_of_the_batch():
    a = _req("a", (1, 2), n=2, seed=9)
    b = _req("b", (3,), n=1, seed=9)
    ids, params, owners = flatten([a, b])
    assert ids == [[1, 2], [1, 2], [3]] and owners == [(0, 0), (0, 1), (1, 0)]
    # Sample j of a request seeded s gets the same seed wherever the request sits in the batch.
    assert [p["sampling_seed"] for p in params] == [derive_seed(9, 0), derive_seed(9, 1), derive_seed(9, 0)]
    assert flatten([b, a])[1][1]["sampling_seed"] == derive_seed(9, 0)
    assert len({derive_seed(s, j) for s in range(50) for j in range(8)}) == 400


def _out(ids, lps, finish="length", text="t"):
    """The shape of one ``sglang.Engine.generate(..., return_logprob=True)`` output."""
    return {
        "text": text,
        "output_ids": ids,
        "meta_info": {"finish_reason": {"type": finish}, "output_token_logprobs": [(lp, t, None) for lp, t in zip(lps, ids)]},
    }


def test_outputs_are_regrouped_in_request_order():
    a, b = _req("a", (1, 2), n=2), _req("b", (3,))
    _, _, owners = flatten([a, b])
    out = gather([a, b], owners, [_out([5], [-0.5]), _out([6, 7], [-1.0, -2.0], "stop"), _out([8], [-3.0])])
    assert [[s.sample_index for s in g] for g in out] == [[0, 1], [0]]
    assert out[0][1].token_ids == (6, 7) and out[0][1].logprobs == (-1.0, -2.0) and out[0][1].stop_reason == "stop"
    assert out[1][0].request_id == "b" and out[1][0].prompt_token_ids == (3,)
    with pytest.raises(RuntimeError, match="do not match its 2 output tokens"):
        gather([b], [(0, 0)], [{"output_ids": [1, 2], "meta_info": {"output_token_logprobs": [(-1.0, 1, None)]}}])
    with pytest.raises(RuntimeError, match="did not finish normally"):
        gather([b], [(0, 0)], [_out([1], [-1.0], "abort")])


def test_sglang_plugins_allowlist():
    env = dict(os.environ)
    try:
        os.environ["SGLANG_PLUGINS"] = "other"
        assert "does not include 'skyrl'" in bootstrap.sglang_plugins_allowlist_problem()
        os.environ["SGLANG_PLUGINS"] = "other,skyrl"
        assert bootstrap.sglang_plugins_allowlist_problem() is None
        os.environ["SGLANG_PLUGINS"] = ""  # SGLang: empty means no allowlist
        assert bootstrap.sglang_plugins_allowlist_problem() is None
    finally:
        os.environ.clear()
        os.environ.update(env)


PROBE = """
import os
from skyrl_core.plugins import hookimpl

@hookimpl
def skyrl_worker_init(role, engine):
    with open(os.path.join(os.environ["SKYRL_PROBE_DIR"], f"init-{os.getpid()}.txt"), "a") as f:
        f.write(f"{role}:{engine}\\n")
"""

# What SGLang's plugin loader does for the group sglang.srt.plugins (SGLang itself needs CUDA).
LOADER = """
import json, os
from importlib.metadata import entry_points
(ep,) = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "skyrl"]
ep.load()()
ep.load()()
from skyrl_sglang import bootstrap
print(json.dumps({"pid": os.getpid(), "ran": bootstrap.ran_in_this_process()}))
"""


@pytest.mark.parametrize("marker", [None, "1"], ids=["marker_unset", "marker_set"])
def test_bootstrap_entry_point_is_inert_without_the_marker(tmp_path, marker):
    plugin = tmp_path / "plugin"
    dist = plugin / "skyrl_sglang_probe-0.0.dist-info"
    dist.mkdir(parents=True)
    (plugin / "skyrl_sglang_probe.py").write_text(textwrap.dedent(PROBE))
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: skyrl-sglang-probe\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text("[skyrl]\nsglang_probe = skyrl_sglang_probe\n")
    reports = tmp_path / "reports"
    reports.mkdir()
    env = {k: v for k, v in os.environ.items() if k != bootstrap.MARKER}
    env.update(PYTHONPATH=f"{plugin}{os.pathsep}{env.get('PYTHONPATH', '')}", SKYRL_PROBE_DIR=str(reports))
    if marker:
        env[bootstrap.MARKER] = marker
    out = subprocess.run([sys.executable, "-c", LOADER], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    files = sorted(p.name for p in reports.iterdir())
    if marker:
        assert result["ran"] is True
        assert files == [f"init-{result['pid']}.txt"]
        assert (reports / files[0]).read_text() == "engine:sglang\n"  # once, though the loader ran twice
    else:
        assert result["ran"] is False and files == []
