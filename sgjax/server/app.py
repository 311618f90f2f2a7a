"""The FastAPI app: SGLang's native routes, the OpenAI routes, health, info, cache and metrics.

Handlers read the raw body and parse it themselves (`protocol.parse_body`), so malformed JSON, invalid UTF-8, unknown
and ill-typed fields all become 400s in one error shape whose message names the field.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import time
from contextlib import asynccontextmanager
from importlib import metadata
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from sgjax.engine.params import SamplingParams
from sgjax.server import native_api, openai_api, token_api
from sgjax.server.connection import ClientDisconnected
from sgjax.server.fields import screener
from sgjax.server.metrics import Metrics
from sgjax.server.protocol import (
    AbortRequest,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    GenerateRequest,
    ScoreRequest,
    TokenizeRequest,
    parse_body,
    read_body,
)
from sgjax.server.serving import HttpWork, Serving
from sgjax.server.training_routes import ROUTES as TRAINING_ROUTES
from sgjax.server.training_routes import add_training_routes

log = logging.getLogger("sgjax.server")

GENERATION_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")
ROUTES = (
    GENERATION_ROUTES
    + (
        "/v1/models",
        "/health",
        "/health_generate",
        "/get_model_info",
        "/get_server_info",
        "/model_info",
        "/server_info",
        "/ready",
        "/flush_cache",
        "/abort_request",
        "/metrics",
        "/tokenize",
        "/detokenize",
        "/v1/embeddings",
        "/v1/score",
        "/start_profile",
        "/stop_profile",
    )
    + TRAINING_ROUTES
)
OPEN_ROUTES = ("/health", "/ready")  # probes answer without --api-key's header, as in SGLang and vLLM


def build_app(serving: Serving) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(serving.finish_shutdown)

    app = FastAPI(title="sgjax", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(InternalErrors)
    if serving.http.api_key:
        app.add_middleware(ApiKey, key=serving.http.api_key, open_routes=OPEN_ROUTES)
    app.add_middleware(RequestMetrics, metrics=serving.metrics)
    started = int(time.time())

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(ClientDisconnected)
    async def client_gone(request: Request, e: ClientDisconnected):
        return Response(status_code=499)  # nobody reads it; 499 marks the abort in the request metrics

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        return JSONResponse(
            ApiError(f"{request.url.path}: {e.detail}", status=e.status_code).body(), status_code=e.status_code
        )

    # -- generation ------------------------------------------------------------------------------------------
    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        req = parse_body(await read_body(request), GenerateRequest, screener("/generate"))
        work, single = native_api.generate_work(req)
        texts = bool(req.return_text_in_logprobs)
        if req.stream:
            merged = serving.merge(await serving.open_streams(work))
            return sse(native_api.generate_events(serving, merged, texts))
        results = await serving.run(work, request.receive)
        if texts:
            results = [native_api.with_token_text(r, serving) for r in results]
        return JSONResponse(results[0] if single else results)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse_body(await read_body(request), CompletionRequest, screener("/v1/completions"))
        return await _openai(request, await openai_api.prepare_completion(serving, req), bool(req.stream))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse_body(await read_body(request), ChatCompletionRequest, screener("/v1/chat/completions"))
        return await _openai(request, await openai_api.prepare_chat(serving, req), bool(req.stream))

    async def _openai(request: Request, prep: openai_api.Prepared, stream: bool):
        if stream:
            merged = serving.merge(await serving.open_streams(prep.work))
            return sse(openai_api.events(serving, prep, merged))
        results = await serving.run(prep.work, request.receive)
        return JSONResponse(openai_api.response(serving, prep, results))

    # -- state -----------------------------------------------------------------------------------------------
    def model_card() -> dict:
        return {
            "id": serving.model_name,
            "object": "model",
            "created": started,
            "owned_by": "sgjax",
            "root": serving.model_path,
            "max_model_len": serving.engine.context_length,
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != serving.model_name:
            raise ApiError(
                f"model: the model {model_id!r} does not exist (this server serves {serving.model_name!r})",
                status=404,
                param="model",
                code="model_not_found",
            )
        return model_card()

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        req = parse_body(await read_body(request), EmbeddingRequest, screener("/v1/embeddings"))
        return await token_api.embeddings(serving, req)

    @app.post("/v1/score")
    async def score(request: Request):
        req = parse_body(await read_body(request), ScoreRequest, screener("/v1/score"))
        return await token_api.score(serving, req)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = parse_body(await read_body(request), TokenizeRequest, screener("/tokenize"))
        return await asyncio.to_thread(token_api.tokenize, serving, req)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = parse_body(await read_body(request), DetokenizeRequest, screener("/detokenize"))
        return await asyncio.to_thread(token_api.detokenize, serving, req)

    @app.get("/ready")
    async def ready():
        # SGLang's readiness probe: the engine is up (the server listens only after loading and warm-up)
        return Response(status_code=200 if serving.healthy else 503)

    @app.get("/health")
    async def health():
        # Answered on the event loop without touching the engine thread: fast whatever the engine is doing.
        return Response(status_code=200 if serving.healthy else 503)

    @app.get("/health_generate")
    async def health_generate(request: Request):
        """Health through the whole engine: one token generated."""
        work = HttpWork(
            params=(SamplingParams(max_new_tokens=1, temperature=0.0),), ids=([0],), prompt_field="input_ids"
        )
        await serving.run(work, request.receive)
        return Response(status_code=200)

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info():
        args = serving.engine.args
        return {
            "model_path": serving.model_path,
            "tokenizer_path": args.tokenizer_path or serving.model_path,
            "is_generation": True,
            "served_model_name": serving.model_name,
            "context_length": serving.engine.context_length,
            "load_format": args.load_format,
            "weight_version": "default",
            "has_image_understanding": serving.engine.images is not None,
            "has_audio_understanding": False,
            "preferred_sampling_params": None,
            "reasoning_parser": None,
            "tool_call_parser": None,
        }

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info():
        info = await serving.info()
        engine_args = dataclasses.asdict(serving.engine.args)
        http = {**dataclasses.asdict(serving.http), "api_key": None if serving.http.api_key is None else "<set>"}
        # SGLang's keys beside ours: its server args at the top level, its scheduler state per data-parallel rank in
        # internal_states (bench_serving reads it)
        mesh = serving.engine.mesh
        args = serving.engine.args
        return {
            **engine_args,
            "tp_size": args.tp_size,
            "dp_size": 1,
            "nnodes": args.nnodes,
            "node_rank": args.node_rank,
            "mesh_shape": dict(mesh.shape),
            "mesh_processes": sorted({d.process_index for d in mesh.devices.flat}),
            **http,
            **info,
            "served_model_name": serving.model_name,
            "version": _version(),
            "frontend": "sgjax",
            "internal_states": [info],
            "server_args": engine_args,
            "http_args": http,
        }

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        if not await asyncio.to_thread(serving.engine.flush_cache):
            raise ApiError("flush_cache: refused while requests are running or waiting (as SGLang)")
        return {"success": True, "message": "Cache flushed."}

    @app.post("/abort_request")
    async def abort_request(request: Request):
        req = parse_body(await read_body(request), AbortRequest, screener("/abort_request"))
        if req.abort_all:
            serving.engine.abort_all()
        elif req.rid is not None:
            serving.engine.abort(req.rid)
        else:
            raise ApiError("rid: required unless abort_all is true", param="rid")
        return {"success": True}

    add_training_routes(app, serving)

    @app.post("/start_profile")
    async def start_profile(request: Request):
        return await asyncio.to_thread(serving.profiler.start)

    @app.post("/stop_profile")
    async def stop_profile(request: Request):
        return await asyncio.to_thread(serving.profiler.stop)

    if serving.http.enable_metrics:

        @app.get("/metrics")
        async def metrics():
            text = serving.metrics.render(await serving.info())
            return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app


def sse(events: AsyncIterator[dict]) -> StreamingResponse:
    """Server-sent events: `data: {json}` per event, then `data: [DONE]`. A client that disconnects cancels the
    iteration (Starlette listens for the disconnect), and the cancellation aborts the engine requests."""

    async def body():
        try:
            async for event in events:
                yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n".encode()
        except ApiError as e:
            yield f"data: {json.dumps(e.body())}\n\n".encode()
        except Exception as e:  # noqa: BLE001 - the status line is sent: report in-band
            log.exception("stream failed")
            err = ApiError(f"internal error: {type(e).__name__}: {e}", status=500, kind="server_error")
            yield f"data: {json.dumps(err.body())}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class InternalErrors:
    """Any exception a route leaks becomes a 500 in the usual error shape, and the connection stays usable. (A
    FastAPI handler for Exception runs in Starlette's outermost middleware, which re-raises after answering, and
    uvicorn then drops the keep-alive connection: the client's next request on it met a reset.)"""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_started(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_started)
        except Exception as e:  # noqa: BLE001 - the point of this middleware
            log.exception("internal error on %s", scope.get("path"))
            if started:  # the status line is out (a stream): nothing more can be said on this response
                return
            err = ApiError(f"internal error: {type(e).__name__}: {e}", status=500, kind="server_error")
            await JSONResponse(err.body(), status_code=500)(scope, receive, send)


class ApiKey:
    """--api-key: every route but the probes needs `Authorization: Bearer <key>`; a 401 in OpenAI's error shape
    otherwise. Pure ASGI, like RequestMetrics, so disconnects still reach the routes."""

    def __init__(self, app, key: str, open_routes: tuple):
        self.app, self.key, self.open_routes = app, key, open_routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open_routes or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        if not secrets.compare_digest(headers.get(b"authorization", b""), b"Bearer " + self.key.encode()):
            err = ApiError(
                "authorization: a valid `Authorization: Bearer <api key>` header is required",
                status=401,
                param="authorization",
                kind="authentication_error",
                code="invalid_api_key",
            )
            return await JSONResponse(err.body(), status_code=401)(scope, receive, send)
        return await self.app(scope, receive, send)


class RequestMetrics:
    """Pure ASGI middleware (Starlette's BaseHTTPMiddleware would wrap `receive` and hide disconnects): counts
    answers by route and status, and times successful generation requests to their last byte."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [499]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope["path"]
            self.metrics.count_request(path if path in ROUTES else "other", status[0])
            if path in GENERATION_ROUTES and status[0] == 200:
                self.metrics.e2e_latency.observe(time.perf_counter() - start)


def _version() -> str:
    try:
        return metadata.version("sgjax")
    except metadata.PackageNotFoundError:
        return "unknown"
