"""The HTTP face of ``TinkerService``: the routes the official ``tinker`` SDK (0.38) calls.

JSON bodies are validated with the SDK's own request types (``tinker.types``), so the wire format
is the SDK's by construction; a body that does not fit gets 422 naming each bad field.
``forward_backward`` bodies are protobuf (``skyrl_tinker.wire``). Every 4xx carries
``x-should-retry: false`` so the SDK reports it instead of retrying it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from skyrl_tinker.service import TinkerError, TinkerService
from skyrl_tinker.wire import WireError, decode_forward_backward

API = "/api/v1"
NO_RETRY = {"x-should-retry": "false"}
# How long retrieve_future holds a request open waiting for its result (the SDK polls again at once,
# logging a warning each time; its own timeout for the call is 45 s).
LONG_POLL_SECONDS = 30.0
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=status, headers=NO_RETRY)


def problems(errors: list[dict]) -> str:
    """Pydantic's validation errors as ``field.path: message; ...`` (the first eight)."""
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in errors[:8])


def owner_of(key: str | None) -> str:
    return "anonymous" if not key else hashlib.sha256(key.encode()).hexdigest()[:16]


async def read_body(request: Any, limit: int) -> bytes:
    """The request's body, refused with 413 as soon as it passes ``limit`` bytes: a chunked body
    has no Content-Length for ``Guard`` to check, and is not held whole before it is measured."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise TinkerError(f"request body exceeds the server's limit of {limit} bytes (sent without a length)", status=413)
        chunks.append(chunk)
    return b"".join(chunks)


class Guard:
    """Refuses a request before any route runs: a declared body over ``max_body_bytes`` (413) or,
    with ``api_keys``, a missing or unknown key (401, except for the health check); gives the
    routes the key's owner (``request.state.owner``).

    A plain ASGI middleware: starlette's ``BaseHTTPMiddleware`` runs every request through a task
    group and memory streams of its own, event-loop time that the worker and sampling threads wait
    for (the GIL) on each of the two dozen requests of an RL step."""

    def __init__(self, app: Any, *, api_keys: set[str] | None, max_body_bytes: int) -> None:
        self.app, self.api_keys, self.max_body_bytes = app, api_keys, max_body_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = key = None
        for name, value in scope["headers"]:  # (names are lower case in ASGI; the first of a repeated one counts)
            if name == b"content-length" and length is None:
                length = value.decode("latin-1")
            elif name == b"x-api-key" and key is None:
                key = value.decode("latin-1")
        refusal = None
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            refusal = error(413, f"request body of {length} bytes exceeds the server's limit of {self.max_body_bytes} bytes")
        elif self.api_keys is not None and scope["path"] != f"{API}/healthz":
            if not key:
                refusal = error(401, "missing API key (header X-API-Key)")
            elif key not in self.api_keys:
                refusal = error(401, "invalid API key")
        if refusal is not None:
            return await refusal(scope, receive, send)
        scope.setdefault("state", {})["owner"] = owner_of(key)
        await self.app(scope, receive, send)


def create_app(service: TinkerService, *, api_keys: set[str] | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    from pydantic import ValidationError
    from tinker import types

    app = FastAPI(title="skyrl Tinker server")
    app.state.service = service

    app.add_middleware(Guard, api_keys=api_keys, max_body_bytes=max_body_bytes)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404 and exc.detail == "Not Found":
            return error(404, f"no route {request.method} {request.url.path}")
        if exc.status_code == 405:
            return error(405, f"{request.url.path} does not accept {request.method}")
        return error(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error(422, problems(exc.errors()))

    @app.exception_handler(TinkerError)
    async def refused(request: Request, exc: TinkerError) -> JSONResponse:
        return error(exc.status, str(exc))

    async def read(request: Request) -> bytes:
        return await read_body(request, max_body_bytes)

    async def body(request: Request, model: type) -> Any:
        raw = await read(request)
        try:
            return model.model_validate_json(raw or b"{}")
        except ValidationError as exc:
            raise TinkerError(f"{model.__name__}: {problems(exc.errors())}", status=422) from None

    def owner(request: Request) -> str:
        return request.state.owner

    def paged(limit: int, offset: int) -> tuple[int, int]:
        for name, value in (("limit", limit), ("offset", offset)):
            if value < 0:
                raise TinkerError(f"query.{name}: must be >= 0; got {value}", status=422)
        return limit, offset

    # --- service --------------------------------------------------------------------------------------

    @app.get(f"{API}/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get(f"{API}/get_server_capabilities")
    async def capabilities() -> dict:
        return {"supported_models": [{"model_name": service.base_model, "max_context_length": service.trainer.max_len,
                                      "trainable": True, "sampleable": True}]}

    @app.post(f"{API}/client/config")
    async def client_config(request: Request) -> dict:
        await body(request, types.ClientConfigRequest)
        # Plain API keys, uncompressed protobuf fwd/bwd, per-request polling, client-side custom losses.
        return {"pjwt_auth_enabled": False, "proto_compress_fwdbwd": False, "sample_use_retrieve_futures": False,
                "custom_loss_server_side": False, "sample_join_sampling_session": False}

    @app.post(f"{API}/client/dynamic_config")
    async def dynamic_config() -> dict:
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @app.post(f"{API}/telemetry")
    async def telemetry() -> dict:
        return {"status": "accepted"}  # the SDK's usage events are not kept

    @app.post(f"{API}/create_session")
    async def create_session(request: Request) -> dict:
        r = await body(request, types.CreateSessionRequest)
        session_id = service.create_session(owner(request), r.tags, r.user_metadata, r.sdk_version)
        return {"type": "create_session", "session_id": session_id}

    @app.post(f"{API}/session_heartbeat")
    async def heartbeat(request: Request) -> dict:
        r = await body(request, types.SessionHeartbeatRequest)
        service.heartbeat(owner(request), r.session_id)
        return {"type": "session_heartbeat"}

    @app.post(f"{API}/sessions/{{session_id}}/finish")
    async def finish_session(request: Request, session_id: str) -> dict:
        service.heartbeat(owner(request), session_id)
        return {}

    # --- training -------------------------------------------------------------------------------------

    def typed_route(path: str, method: Callable[[str, Any], dict], request_type: type) -> None:
        """POST ``path``: the body validated as the SDK's ``request_type``, handed to ``method``."""

        async def endpoint(request: Request) -> dict:
            return method(owner(request), await body(request, request_type))

        app.add_api_route(f"{API}/{path}", endpoint, methods=["POST"], name=path)

    for path, method, request_type in (
        ("create_model", service.create_model, types.CreateModelRequest),
        ("optim_step", service.optim_step, types.OptimStepRequest),
        ("save_weights", service.save_weights, types.SaveWeightsRequest),
        ("save_weights_for_sampler", service.save_weights_for_sampler, types.SaveWeightsForSamplerRequest),
        ("load_weights", service.load_weights, types.LoadWeightsRequest),
        ("asample", service.asample, types.SampleRequest),
    ):
        typed_route(path, method, request_type)

    @app.post(f"{API}/get_info")
    async def get_info(request: Request) -> dict:
        r = await body(request, types.GetInfoRequest)
        return service.get_info(owner(request), r.model_id)

    @app.post(f"{API}/forward_backward")
    async def forward_backward(request: Request) -> dict:
        raw = await read(request)
        if "protobuf" not in request.headers.get("content-type", ""):
            raise TinkerError("forward_backward takes an application/x-protobuf body (tinker SDK >= 0.38)", status=415)
        try:
            call = decode_forward_backward(raw, request.headers.get("content-encoding"))
        except WireError as exc:
            raise TinkerError(str(exc), status=422) from None
        return service.forward_backward(owner(request), call)

    # --- sampling -------------------------------------------------------------------------------------

    @app.post(f"{API}/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict:
        r = await body(request, types.CreateSamplingSessionRequest)
        return {"type": "create_sampling_session", "sampling_session_id": service.create_sampling_session(owner(request), r)}

    @app.get(f"{API}/samplers/{{sampler_id}}")
    async def sampler(request: Request, sampler_id: str) -> dict:
        return service.sampler_info(owner(request), sampler_id)

    # --- futures --------------------------------------------------------------------------------------

    async def finished(future_id: str, timeout: float) -> None:
        """Return when ``future_id`` is finished (or not pending), or after ``timeout`` seconds: woken
        by the worker, not by polling (a poll every few ms per waiting request takes the GIL from
        the worker, which for a small model is most of the step)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def wake() -> None:  # on the worker thread
            try:
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))
            except RuntimeError:  # the loop is closed: the server is stopping, nobody waits
                pass

        if not service.when_finished(future_id, wake):
            return
        try:
            await asyncio.wait_for(done, timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            service.forget_waiter(future_id, wake)

    @app.post(f"{API}/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        r = await body(request, types.FutureRetrieveRequest)
        await finished(r.request_id, LONG_POLL_SECONDS)
        form, payload = service.retrieve(owner(request), r.request_id)
        if form == "proto":
            return Response(payload, media_type="application/x-protobuf")
        return JSONResponse(payload)

    @app.post(f"{API}/retrieve_futures")
    async def retrieve_futures(request: Request) -> dict:
        r = await body(request, types.FuturesRetrieveRequest)
        deadline = min(r.timeout if r.timeout is not None else LONG_POLL_SECONDS, LONG_POLL_SECONDS)
        waited = 0.0
        while True:  # long-poll until something finished after the cursor, or the deadline
            completions, cursor, pending = service.session_completions(owner(request), r.target.sampling_session_id, r.prev_cursor)
            if completions or not pending or waited >= deadline:
                return {"completions": completions, "cursor": cursor}
            await asyncio.sleep(0.01)
            waited += 0.01

    @app.post(f"{API}/cancel_future")
    async def cancel_future() -> dict:
        return {}  # queued work runs to completion; its result is simply not fetched

    # --- checkpoints and training runs ----------------------------------------------------------------

    @app.get(f"{API}/sessions")
    async def sessions(request: Request, limit: int = 20, offset: int = 0) -> dict:
        return service.sessions(owner(request), *paged(limit, offset))

    @app.get(f"{API}/sessions/{{session_id}}")
    async def session(request: Request, session_id: str) -> dict:
        return service.session(owner(request), session_id)

    @app.get(f"{API}/training_runs")
    async def training_runs(request: Request, limit: int = 20, offset: int = 0) -> dict:
        return service.training_runs(owner(request), *paged(limit, offset))

    @app.get(f"{API}/training_runs/{{model_id}}")
    async def training_run(request: Request, model_id: str) -> dict:
        return service.training_run(owner(request), model_id)

    @app.get(f"{API}/training_runs/{{model_id}}/checkpoints")
    async def run_checkpoints(request: Request, model_id: str) -> dict:
        return {"checkpoints": service.checkpoints(owner(request), model_id)}

    @app.delete(f"{API}/training_runs/{{model_id}}/checkpoints/{{checkpoint_id:path}}")
    async def delete_checkpoint(request: Request, model_id: str, checkpoint_id: str) -> dict:
        service.delete_checkpoint(owner(request), model_id, checkpoint_id)
        return {}

    @app.get(f"{API}/checkpoints")
    async def checkpoints(request: Request, limit: int = 100, offset: int = 0) -> dict:
        limit, offset = paged(limit, offset)
        rows = service.checkpoints(owner(request))
        return {"checkpoints": rows[offset : offset + limit], "cursor": {"offset": offset, "limit": limit, "total_count": len(rows)}}

    @app.post(f"{API}/weights_info")
    async def weights_info(request: Request) -> dict:
        try:
            data = json.loads(await read(request) or b"null")
        except ValueError:
            raise TinkerError("body: not JSON", status=422) from None
        path = data.get("tinker_path") if isinstance(data, dict) else None
        if not isinstance(path, str):
            raise TinkerError("tinker_path: required (a tinker:// path)", status=422)
        return service.weights_info(owner(request), path)

    return app
