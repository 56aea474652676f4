"""Every example config runs as shipped, from any directory: each is validated, its datasets
parse, and each trains for one step (only ``trainer.steps``, ``data.eval_size`` and
``trainer.output_dir`` overridden, and for the multi-turn example and the quickstart the size of
that step: see STEP_OVERRIDES; their full steps are measured in docs/benchmarks.md) in a fresh
``skyrl train`` process started elsewhere. The SFT example's run is tests/trainer/test_sft.py's
SmolLM2 test (several steps, through the same check_example_run).
The runs' stderr carries none of the warnings every run used to print."""

from __future__ import annotations

from pathlib import Path

import pytest

from skyrl_core.config.loader import load_config
from skyrl_core.data import load_dataset
from tests.e2e.example_run import check_example_run, example_command

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
# Examples on the SmolLM2 demo model (a real 135M model: heavy, slow); the others are tiny.
SMOLLM2_EXAMPLES = {"quickstart.yaml", "sql_multiturn.yaml", "sft.yaml"}
# The SFT example runs (and is checked as every example is) in test_sft.py's SmolLM2 test, for the
# steps that test needs: one SmolLM2 process fewer (its one-step run here took ~20 s of the suite).
RUN_ELSEWHERE = {"sft.yaml": "tests/trainer/test_sft.py::test_sft_on_smollm2_lowers_eval_loss_and_exports_a_model_that_generates"}
# The multi-turn example: one prompt's group (4 samples) instead of 4, and 2 turns instead of 4 (a
# tool call, its result as the next message, a second turn: the same multi-turn code path; the
# 4-turn step took 68 s of the suite, the shipped step 145 s). The quickstart: 2 prompts' groups
# instead of 8, in micro-batches of 4 so that each of its 2 mini-batches still takes 2 micro-batches
# (gradient accumulation; the 4-group step took 37 s of the suite, the shipped step 92 s).
STEP_OVERRIDES = {
    "sql_multiturn.yaml": ("data.prompts_per_step=1", "environment.options.max_turns=2", "rollout.max_turns=2"),
    "quickstart.yaml": ("data.prompts_per_step=2", "trainer.micro_batch_size=4"),
}


def test_every_example_is_covered() -> None:
    assert {p.name for p in EXAMPLES} == SMOLLM2_EXAMPLES | {"tiny.yaml"}
    for name, test in RUN_ELSEWHERE.items():  # the test that runs it exists and runs that example
        path, function = test.split("::")
        source = (ROOT / path).read_text()
        assert f"def {function}(" in source and f'"examples" / "{name}"' in source, (name, test)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_config_validates_from_another_directory(path: Path, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # data paths in examples are relative to the config file
    cfg = load_config(str(path))
    assert cfg.data.train, "an example must say what it trains on"
    for dataset in (cfg.data.train, cfg.data.eval):
        if dataset and example_command(path) == "train":  # sft rows are conversations: the sft run reads them
            assert load_dataset(dataset, default_env_class=cfg.environment.name)


def test_quickstart_train_and_eval_are_disjoint() -> None:
    train = load_dataset(ROOT / "examples/data/arithmetic/train.jsonl")
    held_out = load_dataset(ROOT / "examples/data/arithmetic/eval.jsonl")
    assert len(train) == 1000 and len(held_out) == 100
    question = lambda row: row["prompt"][-1]["content"]  # noqa: E731
    assert not {question(r) for r in train} & {question(r) for r in held_out}
    assert all(r["env_class"] == "arithmetic" for r in train + held_out)


def test_tiny_example_trains_one_step(tmp_path) -> None:
    check_example_run(ROOT / "examples/tiny.yaml", tmp_path)


def test_tiny_example_on_the_megatron_backend_is_quiet(tmp_path) -> None:
    """megatron-core's seven warnings: six CPU fallback notes (filtered on CPU, see
    skyrl_megatron/quiet_imports.py) and its own deprecated cuda_graph_scope default (set directly)."""
    check_example_run(ROOT / "examples/tiny.yaml", tmp_path, "backend.name=megatron")


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_tiny_example_trains_a_lora_adapter(tmp_path, backend) -> None:
    """``backend.options.lora`` given on the command line runs the whole loop on both backends
    (the nested override is structured, each weight sync sends the merged weights). Plumbing only:
    the tiny model earns no reward here, so what the adapter learns is tested in each backend's
    test_lora.py."""
    check_example_run(ROOT / "examples/tiny.yaml", tmp_path, f"backend.name={backend}", "backend.options.lora.rank=4", steps=2)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SMOLLM2_EXAMPLES - set(RUN_ELSEWHERE)))
def test_smollm2_example_trains_one_step(name: str, tmp_path) -> None:
    check_example_run(ROOT / "examples" / name, tmp_path, *STEP_OVERRIDES.get(name, ()))
