"""The in-process trainer's fp32 products: oneDNN or PyTorch's BLAS (``cpu_gemm``; the default, ``auto``, takes the
faster on this machine, ``tests/core/test_gemm_choice.py``)."""

import numpy as np
import pytest
import torch

from skyrl_tinker.trainer import Example, LoraTrainer


def _examples() -> list[Example]:
    rng = np.random.default_rng(0)
    out = []
    for length in (7, 5, 9):
        full = rng.integers(0, 256, size=length + 1)
        out.append(Example(full[:-1].astype(np.int64), {
            "target_tokens": full[1:].astype(np.int64),
            "logprobs": -rng.random(length).astype(np.float32),
            "advantages": rng.normal(size=length).astype(np.float32),
        }))
    return out


def _with_adapter(trainer: LoraTrainer) -> LoraTrainer:
    """``trainer`` with adapter "a", its B non-zero, so that the adapter's path computes something."""
    trainer.create("a", rank=4, alpha=32.0, groups=("attn", "mlp"), seed=1)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return trainer


def _train(tiny_model: str, cpu_gemm: str) -> tuple[LoraTrainer, list[np.ndarray], dict[str, torch.Tensor]]:
    trainer = _with_adapter(LoraTrainer(tiny_model, cpu_gemm=cpu_gemm))
    logprobs, _ = trainer.forward_backward("a", _examples(), "importance_sampling", None)
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return trainer, logprobs, grads


def test_onednn_products_train_the_adapter_like_blas_ones_within_fp32_rounding(tiny_model):
    onednn, logprobs, grads = _train(tiny_model, "onednn")
    blas, blas_logprobs, blas_grads = _train(tiny_model, "torch")
    # oneDNN computes the base layers' products (the adapter's own stay stock) on peft's cheap
    # unmerged path: the merged path is only for an op plugin's (IsoExec's) own implementations.
    assert onednn.ledger.impl("linear", "trainer_forward").name == "onednn.linear"
    assert onednn.ledger.observed[("linear", "trainer_forward", "onednn.linear")] > 0
    assert not onednn.merged_training and not blas.merged_training
    # (unpatched: the modules' own F.linear, which the ledger does not see)
    assert blas.ledger.impl("linear", "trainer_forward").name == "torch.linear"
    assert not [key for key in blas.ledger.observed if key[0] == "linear"]
    # Only the adapter gets gradients, the same ones up to fp32 rounding.
    assert grads and set(grads) == set(blas_grads) and all(".lora_" in n for n in grads)
    for a, b in zip(logprobs, blas_logprobs):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)
    for name in grads:
        torch.testing.assert_close(grads[name], blas_grads[name], rtol=1e-3, atol=1e-5)


def _cross_entropy_steps(trainer: LoraTrainer, steps: int) -> list[float]:
    from skyrl_tinker.trainer import AdamStep

    trainer.create("a", rank=4, alpha=32.0, groups=("attn", "mlp"), seed=1)
    data = [Example(e.tokens, {"target_tokens": e.inputs["target_tokens"]}) for e in _examples()]
    losses = []
    for _ in range(steps):
        losses.append(trainer.forward_backward("a", data, "cross_entropy", None)[1]["loss:sum"])
        trainer.optim_step("a", AdamStep(4e-3, 0.9, 0.95, 1e-8, 0.0, 0.0))
    return losses


def test_a_bf16_base_trains_fp32_adapters_and_its_loss_falls_like_fp32s(tiny_model):
    """``dtype="bfloat16"``: the frozen base computes in bf16; the adapters (the trained weights) and
    their AdamW moments are fp32; a pass's activations are estimated at half the bytes. Six
    cross-entropy steps lower the loss as fp32's do: both fall by more than 1% a step (13% in
    all, measured) and each of bf16's losses is within 0.2% of fp32's (0.02% measured)."""
    fp32 = LoraTrainer(tiny_model)
    bf16 = LoraTrainer(tiny_model, dtype="bfloat16")
    assert bf16.model.get_input_embeddings().weight.dtype == torch.bfloat16
    assert bf16.bytes_per_token * 2 == fp32.bytes_per_token
    want, got = _cross_entropy_steps(fp32, 6), _cross_entropy_steps(bf16, 6)
    adapter = [p for n, p in bf16.model.named_parameters() if ".lora_" in n]
    assert adapter and all(p.dtype == torch.float32 for p in adapter)
    moments = [s["exp_avg"] for s in bf16.adapters["a"].optimizer.state.values()]
    assert moments and all(m.dtype == torch.float32 for m in moments)
    assert all(b < a * 0.99 for a, b in zip(got, got[1:])) and all(b < a * 0.99 for a, b in zip(want, want[1:]))
    np.testing.assert_allclose(got, want, rtol=0.002)
    assert got != want  # (bf16 did compute in bf16: its losses round differently)


def test_an_unknown_dtype_or_cpu_gemm_is_refused_before_the_model_loads():
    with pytest.raises(ValueError, match="dtype 'float16': allowed: float32, bfloat16"):
        LoraTrainer("/nonexistent", dtype="float16")


def test_an_unknown_cpu_gemm_is_refused_before_the_model_loads():
    with pytest.raises(ValueError, match="cpu_gemm 'mkl': allowed: auto, onednn, torch"):
        LoraTrainer("/nonexistent", cpu_gemm="mkl")


def test_passes_go_in_order_of_length_and_results_come_back_in_the_callers_order(tiny_model, monkeypatch):
    import skyrl_tinker.trainer as trainer_module

    trainer = LoraTrainer(tiny_model)
    trainer.create("a", rank=4, alpha=32.0, groups=("attn", "mlp"), seed=1)
    examples = _examples()  # lengths 7, 5, 9
    alone = [trainer.forward("a", [e], "importance_sampling", None)[0][0] for e in examples]
    # room for two rows of 7 positions: passes of at most two short rows
    monkeypatch.setattr(trainer_module, "MICRO_BATCH_BYTES", trainer.pass_bytes(2, 7))
    plan = list(trainer._micro_batches(examples))
    assert plan == [[1, 0], [2]]  # by length: 5 and 7 pad to 14 positions together; 9 alone
    logprobs, _ = trainer.forward("a", examples, "importance_sampling", None)
    assert [len(x) for x in logprobs] == [7, 5, 9]  # the caller's order, each its own length
    for got, want in zip(logprobs, alone):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def _saved_bytes(trainer: LoraTrainer, examples: list[Example]) -> tuple[int, list[np.ndarray], dict[str, torch.Tensor]]:
    """Bytes autograd saved for backward in one ``forward_backward``, its logprobs and gradients."""
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logprobs, _ = trainer.forward_backward("a", examples, "importance_sampling", None)
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.model.zero_grad(set_to_none=True)
    return sum(saved), logprobs, grads


def test_a_datum_too_long_to_keep_every_activation_trains_with_checkpointed_layers_and_the_same_bits(tiny_model):
    # A long SFT datum used to keep every layer's activations (SmolLM2: 3.9 MB a position plus
    # the attention scores, 4.2 GiB at 1024 tokens): 4096 tokens outgrew a 24 GiB machine.
    trainer, _, _ = _train(tiny_model, "torch")
    trainer.model.zero_grad(set_to_none=True)
    rng = np.random.default_rng(3)
    full = rng.integers(0, 256, size=41)
    long = [Example(full[:-1].astype(np.int64), {"target_tokens": full[1:].astype(np.int64),
                                                 "logprobs": -rng.random(40).astype(np.float32),
                                                 "advantages": rng.normal(size=40).astype(np.float32)})]
    layers = [layer.forward for layer in trainer.model.model.layers]
    plain_bytes, plain_logprobs, plain_grads = _saved_bytes(trainer, long)
    trainer.checkpoint_above_bytes = trainer.pass_bytes(1, 40) - 1  # this datum is now "too long"
    checkpointed_bytes, logprobs, grads = _saved_bytes(trainer, long)
    assert checkpointed_bytes < plain_bytes / 2  # only layer inputs were kept
    # the same computation: logprobs and gradients bit for bit
    assert plain_grads and set(grads) == set(plain_grads)
    for name in grads:
        assert torch.equal(grads[name].view(torch.int32), plain_grads[name].view(torch.int32)), name
    assert np.array_equal(logprobs[0].view(np.int32), plain_logprobs[0].view(np.int32))
    # the layers are their own again after the pass
    assert [layer.forward for layer in trainer.model.model.layers] == layers
    assert not any(hasattr(layer, "_skyrl_checkpointed") for layer in trainer.model.model.layers)
    again, _, _ = _saved_bytes(trainer, _examples())
    assert again > 0 and trainer.pass_bytes(1, 9) <= trainer.checkpoint_above_bytes


def test_the_longest_trainable_datum_fits_half_the_machines_memory(tiny_model):
    from skyrl_core.trainer.memory_estimate import machine_memory_bytes
    from skyrl_tinker.trainer import PASS_MEMORY_SHARE

    trainer = LoraTrainer(tiny_model)
    limit = int(PASS_MEMORY_SHARE * machine_memory_bytes())
    longest = trainer.max_train_tokens
    assert trainer.pass_bytes(1, longest, checkpointed=True) <= limit < trainer.pass_bytes(1, longest + 1, checkpointed=True)
    # the FSDP backend keeps every activation of a pass: its longest datum is a plain pass's
    from skyrl_tinker.backend_trainer import BackendLoraTrainer

    backend = BackendLoraTrainer(tiny_model, "fsdp")
    plain = backend.max_train_tokens
    assert backend.pass_bytes(1, plain) <= limit < backend.pass_bytes(1, plain + 1)


def test_the_server_refuses_a_datum_longer_than_a_pass_can_hold_before_queueing_it(tiny_model, tmp_path):
    from skyrl_tinker.service import TinkerError, TinkerService
    from skyrl_tinker.wire import ForwardBackwardCall, WireDatum

    service = TinkerService(tiny_model, db_url=f"sqlite:///{tmp_path / 'db.sqlite'}", checkpoint_dir=str(tmp_path / "ckpt"))
    try:
        service.trainer.max_train_tokens = 6  # as a big model's long context on a small machine would
        ids = np.arange(1, 9, dtype=np.int64)

        def call(length: int) -> ForwardBackwardCall:
            return ForwardBackwardCall(model_id="m", seq_id=0, loss_fn="cross_entropy", loss_fn_config={}, forward_only=False,
                                       data=[WireDatum(ids[:length], {"target_tokens": ids[1:length + 1], "weights": np.ones(length, np.float32)})])

        assert len(service._examples(call(6))) == 1
        with pytest.raises(TinkerError, match=r"data\[0\]\.model_input: 7 tokens; a training pass of one datum may hold 6 "):
            service._examples(call(7))
    finally:
        service.close()


def test_the_server_refuses_a_training_run_beyond_the_adapters_share_of_memory(tiny_model, tmp_path):
    from types import SimpleNamespace

    from skyrl_tinker.service import TinkerError, TinkerService
    from skyrl_tinker.store import ModelRow

    service = TinkerService(tiny_model, db_url=f"sqlite:///{tmp_path / 'db.sqlite'}", checkpoint_dir=str(tmp_path / "ckpt"))
    try:
        one = service.trainer.adapter_bytes(4, ("attn", "mlp"))
        modules = [service.trainer.model.get_submodule(n) for n in service.trainer.check_groups(("attn", "mlp"))]
        assert one == 16 * 4 * sum(m.in_features + m.out_features for m in modules) > 0
        service.trainer.adapter_memory_bytes = 2 * one  # room for two rank-4 runs
        session = service.create_session("alice", [], None, "test")

        def create(seq: int, rank: int = 4) -> dict:
            lora = SimpleNamespace(rank=rank, train_attn=True, train_mlp=True, train_unembed=False, seed=seq)
            return service.create_model("alice", SimpleNamespace(session_id=session, base_model=None, optimizer_config=None,
                                                                 lora_config=lora, model_seq_id=seq, user_metadata=None))

        create(0), create(1)
        with pytest.raises(TinkerError, match=r"lora_config.rank: a training run of rank 4 on attn, mlp holds .* this server's 2 runs hold"):
            create(2)
        with pytest.raises(TinkerError, match="rank 1 on attn, mlp"):
            create(3, rank=1)  # even a smaller one: the share is full
        assert service.store.get(ModelRow, f"{session}:train:0") is not None
        assert service.store.get(ModelRow, f"{session}:train:2") is None  # nothing made
    finally:
        service.close()


def test_a_flood_of_sampling_requests_runs_in_bounded_calls_and_batches(tiny_model, tmp_path):
    """Requests arriving while the engine generates join it, but never more than MAX_JOINING_CALLS
    generate calls at once nor more than MAX_JOINED_SAMPLES requests in one batch: the rest wait
    for the next batch, and every request is answered."""
    import threading
    import time
    from types import SimpleNamespace

    from skyrl_core.types import SamplingParams
    from skyrl_tinker import service as service_module
    from skyrl_tinker.service import SampleJob, TinkerService

    gate = threading.Event()
    lock = threading.Lock()
    seen = {"in_flight": 0, "most": 0, "loads": 0, "calls": 0}

    class BlockingSampler:
        engine = SimpleNamespace(supports_pause=True)
        full_sets = False

        def load(self, key, tensors, base):
            seen["loads"] += 1  # one per sampling batch

        def ready(self):
            pass

        def sample(self, requests):
            with lock:
                seen["in_flight"] += 1
                seen["calls"] += 1
                seen["most"] = max(seen["most"], seen["in_flight"])
            gate.wait(30)
            with lock:
                seen["in_flight"] -= 1
            return [[("length", (1, 2), (-0.5, -0.25))] for _ in requests]

    service = TinkerService(tiny_model, db_url=f"sqlite:///{tmp_path / 'db.sqlite'}", checkpoint_dir=str(tmp_path / "ckpt"))
    try:
        service._get_sampler = lambda: BlockingSampler()
        job = SampleJob(model_path=None, checkpoint_dir=None, prompt=[1, 2, 3], params=SamplingParams(max_tokens=2), prompt_logprobs=False)
        count = service_module.MAX_JOINED_SAMPLES + 45
        first = service.submit("alice", "sample", None, job)
        while seen["calls"] == 0:
            time.sleep(0.01)
        futures = [first] + [service.submit("alice", "sample", None, job) for _ in range(count - 1)]
        while seen["in_flight"] < service_module.MAX_JOINING_CALLS:  # requests join while the first call runs ...
            time.sleep(0.01)
        time.sleep(0.2)
        assert seen["most"] == service_module.MAX_JOINING_CALLS  # ... in at most this many calls at once
        gate.set()
        deadline = time.monotonic() + 60
        while any(f["request_id"] in service._pending for f in futures) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(f["request_id"] in service._pending for f in futures)
        assert seen["loads"] == 2  # MAX_JOINED_SAMPLES in the first batch, the other 45 in a second
        from skyrl_tinker.store import DONE, FutureRow

        rows = [service.store.get(FutureRow, f["request_id"]) for f in futures]
        assert [r.status for r in rows] == [DONE] * count
    finally:
        gate.set()
        service.close()


class RecordingSampler:
    """A stand-in for the service's sampler that records each engine call's request count and start
    time (``sizes``, ``starts``) and answers every request with one two-token sample."""

    full_sets = False

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.engine = SimpleNamespace(supports_pause=False)
        self.sizes: list[int] = []
        self.starts: list[float] = []

    def load(self, key, tensors, base):
        pass

    def ready(self):
        pass

    def sample(self, requests):
        import time

        self.sizes.append(len(requests))
        self.starts.append(time.monotonic())
        return [[("length", (1, 2), (-0.5, -0.25))] for _ in requests]


@pytest.mark.parametrize("gather", [True, False])
def test_a_burst_of_sampling_requests_starts_as_one_engine_call(tiny_model, tmp_path, monkeypatch, gather):
    """Requests that keep arriving (each within SAMPLE_GATHER_QUIET_S of the last) wait for each
    other and start as one generate call; other queued work ends the wait at once and runs after
    them, and SAMPLE_GATHER_MAX_S bounds it. Negative control (``gather=False``, no wait): the same
    burst starts with the first request alone."""
    import time

    from skyrl_core.types import SamplingParams
    from skyrl_tinker import service as service_module
    from skyrl_tinker.service import SampleJob, TinkerService
    from skyrl_tinker.store import DONE, FutureRow

    monkeypatch.setattr(service_module, "SAMPLE_GATHER_QUIET_S", 5.0 if gather else 0.0)
    monkeypatch.setattr(service_module, "SAMPLE_GATHER_MAX_S", 20.0 if gather else 0.0)
    sampler, ran = RecordingSampler(), []
    calls = sampler.sizes

    service = TinkerService(tiny_model, db_url=f"sqlite:///{tmp_path / 'db.sqlite'}", checkpoint_dir=str(tmp_path / "ckpt"))
    try:
        service._get_sampler = lambda: sampler
        job = SampleJob(model_path=None, checkpoint_dir=None, prompt=[1, 2, 3], params=SamplingParams(max_tokens=2), prompt_logprobs=False)
        start = time.monotonic()
        futures = []
        for _ in range(8):
            futures.append(service.submit("alice", "sample", None, job))
            time.sleep(0.05)
        other = service.submit("alice", "other", None, lambda: (ran.append(time.monotonic()), ("json", {}))[1])
        deadline = time.monotonic() + 30
        while other["request_id"] in service._pending and time.monotonic() < deadline:
            time.sleep(0.01)
        rows = [service.store.get(FutureRow, f["request_id"]) for f in [*futures, other]]
        assert [r.status for r in rows] == [DONE] * 9
        if gather:
            assert calls == [8]
            assert ran[0] - start < 4.0  # the other work ended the 5 s wait
            # a lone request waits SAMPLE_GATHER_MAX_S at most
            monkeypatch.setattr(service_module, "SAMPLE_GATHER_MAX_S", 0.3)
            lone, begun = service.submit("alice", "sample", None, job), time.monotonic()
            while lone["request_id"] in service._pending and time.monotonic() - begun < 30:
                time.sleep(0.01)
            assert calls == [8, 1] and time.monotonic() - begun < 4.0
        else:
            assert calls[0] == 1 and sum(calls) == 8
    finally:
        service.close()


@pytest.mark.parametrize("arrived_during", ["earlier work", "the wait"])
def test_the_gathers_quiet_window_counts_from_the_last_arrival(tiny_model, tmp_path, monkeypatch, arrived_during):
    """A burst that arrived while the worker was busy (here: other work; in a step: the adapter's
    merge) starts as soon as the worker is free, not a quiet window later; requests still arriving
    are waited for as before (the negative control: the same burst spread over the wait)."""
    import threading
    import time

    from skyrl_core.types import SamplingParams
    from skyrl_tinker import service as service_module
    from skyrl_tinker.service import SampleJob, TinkerService

    quiet = 2.0
    monkeypatch.setattr(service_module, "SAMPLE_GATHER_QUIET_S", quiet)
    monkeypatch.setattr(service_module, "SAMPLE_GATHER_MAX_S", 20.0)
    sampler = RecordingSampler()

    service = TinkerService(tiny_model, db_url=f"sqlite:///{tmp_path / 'db.sqlite'}", checkpoint_dir=str(tmp_path / "ckpt"))
    gate = threading.Event()
    try:
        service._get_sampler = lambda: sampler
        job = SampleJob(model_path=None, checkpoint_dir=None, prompt=[1, 2, 3], params=SamplingParams(max_tokens=2), prompt_logprobs=False)
        if arrived_during == "earlier work":
            service.submit("alice", "other", None, lambda: (gate.wait(30), ("json", {}))[1])
            futures = [service.submit("alice", "sample", None, job) for _ in range(4)]
            time.sleep(quiet + 0.5)  # every request is older than the quiet window
            freed = time.monotonic()
            gate.set()
        else:
            futures = []
            for i in range(4):
                if i:
                    time.sleep(0.2)
                futures.append(service.submit("alice", "sample", None, job))
            freed = time.monotonic()  # the last arrival
        deadline = time.monotonic() + 30
        while any(f["request_id"] in service._pending for f in futures) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sampler.sizes == [4]
        (started,) = sampler.starts
        if arrived_during == "earlier work":
            assert started - freed < quiet / 2  # no quiet window after the worker was freed
        else:
            assert started - freed >= quiet * 0.9  # a quiet window after the last arrival
    finally:
        gate.set()
        service.close()


def test_a_burst_as_large_as_the_models_last_burst_starts_at_its_last_request(tiny_model, tmp_path, monkeypatch):
    """An RL loop sends the same burst of sampling requests every step: once as many as the model's
    last burst had have come, the batch starts without a quiet window. A first burst and another
    model's (the negative control) wait as before; a larger one starts at the last one's size and
    its extras are gathered as before (one batch, not one each); the next burst expects its size."""
    import time

    from skyrl_core.types import SamplingParams
    from skyrl_tinker import service as service_module
    from skyrl_tinker.service import SampleJob, TinkerService

    quiet = 1.5
    monkeypatch.setattr(service_module, "SAMPLE_GATHER_QUIET_S", quiet)
    monkeypatch.setattr(service_module, "SAMPLE_GATHER_MAX_S", 20.0)
    sampler = RecordingSampler()
    service = TinkerService(tiny_model, db_url=f"sqlite:///{tmp_path / 'db.sqlite'}", checkpoint_dir=str(tmp_path / "ckpt"))
    try:
        service._get_sampler = lambda: sampler
        service._sampler_weights = lambda path, directory: None

        def burst(model: str, count: int) -> float:
            """Seconds from the burst's last request to its batch's start."""
            job = SampleJob(model_path=f"tinker://{model}/sampler_weights/s", checkpoint_dir=None, prompt=[1, 2, 3],
                            params=SamplingParams(max_tokens=2), prompt_logprobs=False)
            calls = len(sampler.starts)
            futures = []
            for i in range(count):
                if i:
                    time.sleep(0.1)
                futures.append(service.submit("alice", "sample", None, job))
            last = time.monotonic()
            deadline = last + 30
            while any(f["request_id"] in service._pending for f in futures) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not any(f["request_id"] in service._pending for f in futures)
            return sampler.starts[calls] - last

        assert burst("m", 4) >= quiet * 0.9  # no last batch: a quiet window
        assert burst("m", 4) < quiet / 2  # the last burst's count came: no quiet window
        assert burst("other", 4) >= quiet * 0.9  # another model's count says nothing of this one
        assert burst("m", 6) < 0  # (the first four started at the fourth)
        assert burst("m", 6) < quiet / 2  # the last burst had 6 (however it was batched)
        assert sampler.sizes == [4, 4, 4, 4, 2, 6]  # the larger burst's extras were gathered, then ran
    finally:
        service.close()


def test_threads_that_hand_computing_over_release_their_openmp_teams(tiny_model, tmp_path, monkeypatch):
    """The thread that built the service (it loaded the model) and the worker (it merged the
    adapter) release their OpenMP teams before the sampling threads compute: an idle team beside a
    computing one makes libgomp throttle both (``skyrl_core.openmp_teams``)."""
    import threading
    import time
    from types import SimpleNamespace

    from skyrl_core.types import SamplingParams
    from skyrl_tinker import service as service_module
    from skyrl_tinker.service import SampleJob, TinkerService

    events: list[tuple[str, str]] = []
    monkeypatch.setattr(service_module, "release_thread_team", lambda: events.append(("release", threading.current_thread().name)) or True)

    class RecordingSampler:
        engine = SimpleNamespace(supports_pause=True)  # generate runs on sampling threads
        full_sets = False

        def load(self, key, tensors, base):
            events.append(("load", threading.current_thread().name))

        def ready(self):
            pass

        def sample(self, requests):
            events.append(("sample", threading.current_thread().name))
            return [[("length", (1, 2), (-0.5, -0.25))] for _ in requests]

    service = TinkerService(tiny_model, db_url=f"sqlite:///{tmp_path / 'db.sqlite'}", checkpoint_dir=str(tmp_path / "ckpt"))
    try:
        assert events == [("release", threading.current_thread().name)]
        service._get_sampler = lambda: RecordingSampler()
        job = SampleJob(model_path=None, checkpoint_dir=None, prompt=[1, 2, 3], params=SamplingParams(max_tokens=2), prompt_logprobs=False)
        future = service.submit("alice", "sample", None, job)
        deadline = time.monotonic() + 30
        while future["request_id"] in service._pending and time.monotonic() < deadline:
            time.sleep(0.01)
        assert events[1:] == [("load", "tinker-worker"), ("release", "tinker-worker"), ("sample", "tinker-sample")]
    finally:
        service.close()


def _failing_second_pass(trainer: LoraTrainer, monkeypatch: pytest.MonkeyPatch, where: str):
    """From now on every pass holds one datum, and the second pass of the next call fails: in its
    loss, or inside its backward once the later layers' adapter gradients were already added (a hook
    on the gradient of the first layer's output, which backward reaches last)."""
    import skyrl_tinker.trainer as trainer_module
    from skyrl_core.backends.activation_checkpointing import decoder_layers

    monkeypatch.setattr(trainer, "_micro_batches", lambda examples: ([i] for i in range(len(examples))))
    passes = [0]
    real_loss = trainer_module.compute_loss

    def compute_loss(*args, **kwargs):
        passes[0] += 1
        if passes[0] == 2 and where == "loss":
            raise RuntimeError("loss failed")
        return real_loss(*args, **kwargs)

    def fail_in_backward(grad):
        if passes[0] == 2:
            raise RuntimeError("backward failed")
        return grad

    def hook_output(module, inputs, output):
        hidden = output[0] if isinstance(output, tuple) else output
        if hidden.requires_grad:
            hidden.register_hook(fail_in_backward)

    monkeypatch.setattr(trainer_module, "compute_loss", compute_loss)
    if where == "backward":
        return decoder_layers(trainer.model)[0].register_forward_hook(hook_output).remove
    return lambda: None


def _adapter_grads(trainer: LoraTrainer) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in trainer.model.named_parameters() if ".lora_" in n}


@pytest.mark.parametrize("where", ["loss", "backward"])
@pytest.mark.parametrize("guarded", [True, False])
def test_a_forward_backward_failing_in_its_second_pass_leaves_the_gradients_as_found(tiny_model, monkeypatch, where, guarded):
    """The first pass's gradients are already added when the second fails; the call puts back the
    gradients it found, bit for bit: none (after an optimizer step), or those of an earlier call.
    Negative control (``guarded=False``, the restoring removed): the failed call's part-batch stays."""
    import contextlib

    import skyrl_tinker.trainer as trainer_module

    if not guarded:
        monkeypatch.setattr(trainer_module, "gradients_restored_on_failure", lambda params: contextlib.nullcontext())
    trainer = LoraTrainer(tiny_model)
    trainer.create("a", rank=4, alpha=32.0, groups=("attn", "mlp"), seed=1)
    with torch.no_grad():  # a non-zero B, so that every adapter tensor gets a gradient
        for name, p in trainer.model.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    data = _examples()
    for earlier in (False, True):
        trainer.adapters["a"].optimizer.zero_grad(set_to_none=True)
        if earlier:  # a caller accumulating over calls
            trainer.forward_backward("a", data[:1], "importance_sampling", None)
        found = _adapter_grads(trainer)
        assert all((g is not None) == earlier for g in found.values())
        with monkeypatch.context() as patch:
            unhook = _failing_second_pass(trainer, patch, where)
            with pytest.raises(RuntimeError, match=f"{where} failed"):
                trainer.forward_backward("a", data, "importance_sampling", None)
            unhook()
        after = _adapter_grads(trainer)
        same = all(
            (a is None and b is None) or (a is not None and b is not None and torch.equal(a.view(torch.int32), b.view(torch.int32)))
            for a, b in zip(found.values(), after.values())
        )
        assert same == guarded
        # and the adapter trains on afterwards
        trainer.forward_backward("a", data, "importance_sampling", None)


def _rl_group_examples() -> list[Example]:
    """Two prompts' samples, as an RL loop sends them: each datum is its prompt and one response,
    the prompts' datums interleaved, loss weights on the responses."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 256, size=n) for n in (12, 9)]
    out = []
    for index, length in enumerate((4, 7, 2, 5, 6, 3)):
        prompt = prompts[index % 2]
        full = np.concatenate([prompt, rng.integers(1, 256, size=length + 1)])
        weights = np.zeros(len(full) - 1, dtype=np.float32)
        weights[len(prompt) - 1:] = 1.0
        out.append(Example(full[:-1].astype(np.int64), {
            "target_tokens": full[1:].astype(np.int64),
            "logprobs": -rng.random(len(full) - 1).astype(np.float32),
            "advantages": (rng.normal() * weights).astype(np.float32),
        }))
    return out


def test_data_that_share_a_prompt_are_computed_once_with_the_logprobs_and_gradients_of_each(tiny_model, monkeypatch):
    """A batch of two prompts' samples: the prefix they share is computed once per prompt (counted),
    and so is its output head but at its last position, whose target is each datum's own (rows
    counted); every position's logprob (prompt positions included, which the API returns) and the
    adapter's gradients are those of the data computed apart within fp32 rounding."""
    import skyrl_tinker.trainer as trainer_module

    packed_calls, head_rows = [], []
    real = trainer_module.run_packed
    monkeypatch.setattr(trainer_module, "run_packed", lambda model, packed, consume: (
        packed_calls.append(tuple(packed.input_ids.shape)), real(model, packed, consume))[1])
    real_logprobs = trainer_module.token_logprobs
    monkeypatch.setattr(trainer_module, "token_logprobs", lambda logits, targets, **kw: (
        head_rows.append(logits.shape[0]), real_logprobs(logits, targets, **kw))[1])

    def run(sharing: bool):
        trainer = LoraTrainer(tiny_model)
        if not sharing:
            trainer.pair_cost = None
        _with_adapter(trainer)
        logprobs, metrics = trainer.forward_backward("a", _rl_group_examples(), "importance_sampling", None)
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        return logprobs, metrics, grads

    apart = run(False)
    assert packed_calls == [] and head_rows == [90]  # data of 16, 14, 18 and 16, 14, 12 positions
    shared = run(True)
    # one pass, one sequence per prompt: 12 + (4 + 2 + 6) and 9 + (7 + 5 + 3) positions
    assert packed_calls == [(2, 24)]
    # heads: 11 prompt positions + 5 + 3 + 7 of the data's own, and 8 + 8 + 6 + 4
    assert head_rows == [90, 52]
    for got, want in zip(shared[0], apart[0]):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert shared[1]["loss:sum"] == pytest.approx(apart[1]["loss:sum"], abs=1e-5)
    assert shared[2].keys() == apart[2].keys() and apart[2]
    for name, grad in apart[2].items():
        assert (shared[2][name] - grad).norm() <= 1e-5 * grad.norm() + 1e-8, name


def test_weights_saved_for_sampling_are_sampled_from_memory_with_the_files_bits(tiny_model, tmp_path, monkeypatch):
    """An RL loop saves weights for sampling each step and samples them next: the sampler takes the
    tensors the save wrote, without reading the file back, and they are the file's bits."""
    import threading
    from types import SimpleNamespace

    from skyrl_core import lora as lora_lib
    from skyrl_tinker import trainer as trainer_module
    from skyrl_tinker.service import TinkerService
    from skyrl_tinker.store import CheckpointRow

    service = TinkerService(tiny_model, db_url=f"sqlite:///{tmp_path / 'db.sqlite'}", checkpoint_dir=str(tmp_path / "ckpt"))
    try:
        session = service.create_session("alice", [], None, "test")
        lora = SimpleNamespace(rank=4, train_attn=True, train_mlp=True, train_unembed=False, seed=3)
        model_id = service.create_model("alice", SimpleNamespace(session_id=session, base_model=None, optimizer_config=None,
                                                                 lora_config=lora, model_seq_id=0, user_metadata=None))["model_id"]
        with torch.no_grad():  # (a fresh adapter's B is zero: make the saved tensors tell adapters apart)
            for p in lora_lib.adapter_parameters(service.trainer.model, model_id):
                p.add_(0.01)
        future = service.save_weights_for_sampler("alice", SimpleNamespace(model_id=model_id, kind="snapshot", path=None, user_metadata=None))
        finished = threading.Event()
        if service.when_finished(future["request_id"], finished.set):
            assert finished.wait(60)
        path, cached = service._sampler_tensors
        directory = service.store.get(CheckpointRow, path).directory
        reads = []
        real_read = trainer_module.read_adapter
        monkeypatch.setattr(trainer_module, "read_adapter", lambda d: reads.append(d) or real_read(d))
        taken = service._sampler_weights(path, directory)
        assert reads == []  # from memory
        on_disk = real_read(directory)
        assert set(taken) == set(on_disk) and len(taken) > 0
        for key, value in on_disk.items():
            assert torch.equal(taken[key].view(torch.int32), value.view(torch.int32)), key
        service._sampler_tensors = None  # negative control: without the saved copy, the file is read
        service._sampler_weights(path, directory)
        assert reads == [directory]
    finally:
        service.close()


def test_weights_saved_for_sampling_are_merged_into_the_engine_at_the_save_when_it_holds_the_models_last(tiny_model, tmp_path):
    """The engine holds model A's last sampler checkpoint: A's next one is merged in by the save
    itself (bit-equal to the merge a sampling request would do), and B's save leaves A's in place."""
    import threading
    from types import SimpleNamespace

    from skyrl_core import lora as lora_lib
    from skyrl_tinker.service import TinkerService

    service = TinkerService(tiny_model, db_url=f"sqlite:///{tmp_path / 'db.sqlite'}", checkpoint_dir=str(tmp_path / "ckpt"))

    def wait(future: dict) -> None:
        finished = threading.Event()
        if service.when_finished(future["request_id"], finished.set):
            assert finished.wait(60)

    def save(model_id: str) -> str:
        with torch.no_grad():  # (new weights each save)
            for p in lora_lib.adapter_parameters(service.trainer.model, model_id):
                p.add_(0.01)
        wait(service.save_weights_for_sampler("alice", SimpleNamespace(model_id=model_id, kind="snapshot", path=None, user_metadata=None)))
        return service._sampler_tensors[0]

    def engine_bits() -> dict[str, list]:
        return {n: p.detach().view(torch.int32).flatten().tolist() for n, p in service._sampler.engine._params.items()}

    try:
        session = service.create_session("alice", [], None, "test")
        lora = SimpleNamespace(rank=4, train_attn=True, train_mlp=True, train_unembed=False, seed=3)
        a, b = (service.create_model("alice", SimpleNamespace(session_id=session, base_model=None, optimizer_config=None,
                                                              lora_config=lora, model_seq_id=i, user_metadata=None))["model_id"]
                for i in (0, 1))
        first = save(a)
        assert service._sampler is None  # no engine yet: nothing to merge into
        sampler = service._get_sampler()
        sampler.load(first, service._sampler_tensors[1], service.trainer.base_weights())  # (a sampling request did)
        second = save(a)
        assert sampler.loaded == second and second != first
        preloaded = engine_bits()
        sampler.load(None, None, service.trainer.base_weights())
        sampler.load(second, service._sampler_weights(second, None), service.trainer.base_weights())
        assert engine_bits() == preloaded  # the merge a sampling request does
        save(b)
        assert sampler.loaded == second and engine_bits() == preloaded  # another model's: left alone
    finally:
        service.close()


def test_a_saved_checkpoints_rows_are_written_with_its_future_in_one_transaction(tiny_model, tmp_path, monkeypatch):
    """The save's work writes its files and returns its rows (checkpoint, sampling session): they
    are committed in the transaction that finishes the future, so a crash between the two cannot
    leave a listed checkpoint whose save is reported failed."""
    import threading
    from types import SimpleNamespace

    from skyrl_tinker.service import TinkerService
    from skyrl_tinker.store import CheckpointRow, SamplingSessionRow

    service = TinkerService(tiny_model, db_url=f"sqlite:///{tmp_path / 'db.sqlite'}", checkpoint_dir=str(tmp_path / "ckpt"))
    try:
        session = service.create_session("alice", [], None, "test")
        lora = SimpleNamespace(rank=4, train_attn=True, train_mlp=True, train_unembed=False, seed=3)
        created = service.create_model("alice", SimpleNamespace(session_id=session, base_model=None, optimizer_config=None,
                                                                lora_config=lora, model_seq_id=0, user_metadata=None))
        model_id = created["model_id"]
        made = threading.Event()
        if service.when_finished(created["request_id"], made.set):
            assert made.wait(60)
        queued = []
        monkeypatch.setattr(service, "submit", lambda owner, kind, model, work, **extra: queued.append(work) or {})
        service.save_weights_for_sampler("alice", SimpleNamespace(model_id=model_id, kind="snapshot", path=None, user_metadata=None))
        form, payload, rows = queued[0]()
        path = rows[0].tinker_path
        assert [type(r) for r in rows] == [CheckpointRow, SamplingSessionRow] and rows[1].model_path == path
        assert service.store.get(CheckpointRow, path) is None  # nothing written by the work itself
        assert service.store.get(SamplingSessionRow, payload["sampling_session_id"]) is None
        monkeypatch.undo()
        fid = service.submit("alice", "save_weights_for_sampler", model_id, lambda: (form, payload, rows))["request_id"]
        finished = threading.Event()
        if service.when_finished(fid, finished.set):
            assert finished.wait(60)
        assert service.store.get(CheckpointRow, path) is not None  # written with the future
        assert service.retrieve("alice", fid)[1]["sampling_session_id"] == payload["sampling_session_id"]
    finally:
        service.close()


def test_a_batch_is_padded_on_the_right_with_each_datums_values_and_zeros_elsewhere():
    """``_pad``: ragged data (and one datum without ``advantages``, one with float64 values) give
    ``[B, T]`` ids, mask and inputs holding each datum's values at its own positions, zeros past
    its end and where it lacks an input, targets as int64 and the rest rounded to float32."""
    data = [
        Example(np.array([5, 6, 7], dtype=np.int64), {"target_tokens": np.array([6, 7, 8]), "advantages": np.array([0.5, -1.0, 2.0], dtype=np.float32)}),
        Example(np.array([9], dtype=np.int64), {"target_tokens": np.array([3])}),
        Example(np.array([1, 2], dtype=np.int64), {"target_tokens": np.array([2, 4]), "advantages": np.array([0.1, 0.2], dtype=np.float64)}),
    ]
    ids, mask, inputs = LoraTrainer._pad(data)
    assert ids.tolist() == [[5, 6, 7], [9, 0, 0], [1, 2, 0]] and ids.dtype == torch.int64
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]] and mask.dtype == torch.float32
    assert set(inputs) == {"target_tokens", "advantages"}
    assert inputs["target_tokens"].tolist() == [[6, 7, 8], [3, 0, 0], [2, 4, 0]] and inputs["target_tokens"].dtype == torch.int64
    advantages = inputs["advantages"]
    assert advantages.dtype == torch.float32
    expected = torch.tensor([[0.5, -1.0, 2.0], [0.0, 0.0, 0.0], [0.1, 0.2, 0.0]], dtype=torch.float64).float()
    assert torch.equal(advantages.view(torch.int32), expected.view(torch.int32))

    # An input of another length than its datum's tokens (a shift that keeps a batch's total would
    # misalign every row after it in _pad) is refused when the datum is made.
    with pytest.raises(ValueError, match="Example: target_tokens has 3 values for 2 tokens"):
        Example(np.array([1, 2], dtype=np.int64), {"target_tokens": np.array([2, 3, 4])})


def test_an_adapter_on_a_tied_unembedding_trains_the_output_projection_alone(tied_tiny_model):
    """``train_unembed`` on a model whose lm_head is its embedding: the adapter's lm_head part gets
    gradients and moves, the embedding keeps its bits, and ``forward`` (the merged weights, as the
    sampler gets them) computes the logits of the merged head over the base embedding: a model
    whose lm_head alone is merged, not one whose tied tensor was (negative control)."""
    import copy

    from skyrl_core import lora
    from skyrl_tinker.trainer import AdamStep

    trainer = LoraTrainer(tied_tiny_model)
    assert lora.ties_unembedding(trainer.model)
    embedding = trainer.model.get_input_embeddings().weight.detach().clone()
    trainer.create("a", rank=4, alpha=32.0, groups=("attn", "mlp", "unembed"), seed=1)
    data = [Example(e.tokens, {"target_tokens": e.inputs["target_tokens"]}) for e in _examples()]
    for step in range(2):
        trainer.forward_backward("a", data, "cross_entropy", None)
        head_grads = [p.grad for n, p in trainer.model.named_parameters() if n.startswith("lm_head.lora_")]
        # (B starts at zero: A's gradient is zero until B has moved)
        assert len(head_grads) == 2 and all(g is not None and g.abs().max() > 0 for g in head_grads[step == 0:])
        trainer.optim_step("a", AdamStep(4e-3, 0.9, 0.95, 1e-8, 0.0, 0.0))
    assert torch.equal(trainer.model.get_input_embeddings().weight.view(torch.int32), embedding.view(torch.int32))
    tensors = trainer.adapter_tensors("a")
    merged = dict(lora.merged_weights(trainer.base_weights(), tensors))
    assert "lm_head.weight" in merged and not torch.equal(merged["lm_head.weight"], embedding)
    assert torch.equal(trainer.hf_weights()["lm_head.weight"], embedding)  # (a full set names the tied head too)

    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tied_tiny_model)
    written_through = copy.deepcopy(reference)  # the tied tensor set to the merged head: embedding too
    with torch.no_grad():
        for name, value in merged.items():
            if name != "lm_head.weight":
                reference.get_parameter(name).copy_(value)
                written_through.get_parameter(name).copy_(value)
        reference.lm_head.weight = torch.nn.Parameter(merged["lm_head.weight"].clone())
        written_through.lm_head.weight.copy_(merged["lm_head.weight"])
    example = data[0]
    logprobs = trainer.forward("a", [example], "cross_entropy", None)[0][0]
    ids = torch.from_numpy(example.tokens)[None]
    targets = torch.from_numpy(example.inputs["target_tokens"])

    def expected(model: torch.nn.Module) -> np.ndarray:
        with torch.no_grad():
            return torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)[torch.arange(len(targets)), targets].numpy()

    np.testing.assert_allclose(logprobs, expected(reference), rtol=0, atol=1e-5)
    assert np.abs(expected(written_through) - expected(reference)).max() > 1e-3
