"""``cpu_gemm: auto``: both libraries timed on this machine, the faster taken (oneDNN on a tie),
the answer kept per machine so that every process of a run takes the same library."""

from __future__ import annotations

import json
import multiprocessing as mp

import pytest
import torch

from skyrl_core.ops import gemm_choice, onednn

pytestmark = pytest.mark.skipif(not onednn.available(), reason="this PyTorch has no oneDNN: auto is always torch")


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("SKYRL_CACHE_DIR", str(tmp_path))
    gemm_choice.faster_fp32_gemm.cache_clear()
    yield tmp_path
    gemm_choice.faster_fp32_gemm.cache_clear()


def test_choose_takes_the_faster_and_onednn_on_a_tie():
    assert gemm_choice.choose({"onednn": 100.0, "torch": 120.0}) == "torch"
    assert gemm_choice.choose({"onednn": 120.0, "torch": 100.0}) == "onednn"
    assert gemm_choice.choose({"onednn": 100.0, "torch": 104.0}) == "onednn"  # within TIE


def test_measured_once_and_kept_per_machine(fresh, monkeypatch):
    calls = []

    def fake_measure():
        calls.append(1)
        return {"onednn": 80.0, "torch": 112.0}

    monkeypatch.setattr(gemm_choice, "measure", fake_measure)
    assert gemm_choice.faster_fp32_gemm() == "torch"
    kept = json.loads((fresh / gemm_choice.CACHE_FILE).read_text())
    assert kept == {gemm_choice.machine_key(): {"choice": "torch", "gflops": {"onednn": 80.0, "torch": 112.0}}}
    gemm_choice.faster_fp32_gemm.cache_clear()  # a new process: reads the file, does not measure
    monkeypatch.setattr(gemm_choice, "measure", lambda: pytest.fail("measured again"))
    assert gemm_choice.faster_fp32_gemm() == "torch"
    assert len(calls) == 1


def test_auto_resolves_in_linear_defaults(fresh, monkeypatch):
    for answer, expected in (("torch", {}), ("onednn", {"linear": onednn.ONEDNN_LINEAR})):
        (fresh / gemm_choice.CACHE_FILE).write_text(json.dumps({gemm_choice.machine_key(): {"choice": answer}}))
        gemm_choice.faster_fp32_gemm.cache_clear()
        assert gemm_choice.linear_defaults("auto", torch.float32) == expected
    assert gemm_choice.linear_defaults("onednn", torch.float32) == {"linear": onednn.ONEDNN_LINEAR}  # explicit: no measuring
    assert gemm_choice.linear_defaults("torch", torch.float32) == {}


def test_a_real_measurement_names_both_rates_and_a_library(fresh):
    rates = gemm_choice.measure()
    assert set(rates) == {"onednn", "torch"} and all(10 < r < 100_000 for r in rates.values())
    assert gemm_choice.faster_fp32_gemm() in ("onednn", "torch")


def _answer(directory: str, queue) -> None:
    import os

    os.environ["SKYRL_CACHE_DIR"] = directory
    from skyrl_core.ops import gemm_choice as choice

    queue.put(choice.faster_fp32_gemm())


def test_concurrent_processes_take_one_answer(fresh):
    """Two processes starting at once (two ranks): one measures under the lock, the other reads."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_answer, args=(str(fresh), queue)) for _ in range(2)]
    for p in procs:
        p.start()
    answers = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    kept = json.loads((fresh / gemm_choice.CACHE_FILE).read_text())
    assert len(kept) == 1 and answers == [next(iter(kept.values()))["choice"]] * 2
