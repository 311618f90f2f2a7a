"""The router's HTTP app: the server's routes, answered by forwarding to the workers (`proxy.Router`).

Generation routes go to one worker chosen by the policy (or by the data-parallel rank the request names); read-only
model routes to any healthy worker; /flush_cache and /abort_request to all of them; /health and /get_server_info
report on all of them. Errors the router makes itself have the server's shape (`{"error": {"message", "type",
"param", "code"}}`).
"""

from __future__ import annotations

from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from sgjax.router.proxy import Router
from sgjax.server.connection import ClientDisconnected, until_disconnected
from sgjax.server.protocol import ApiError

GENERATION_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")
# Token counters summed over workers in /get_server_info.
_SUMMED = (
    "prompt_tokens",
    "cached_tokens",
    "running_requests",
    "waiting_requests",
    "max_total_tokens",
    "generated_tokens",
    "retractions",
)


def build_router_app(router: Router) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        await router.start()
        yield
        await router.close()

    app = FastAPI(title="sgjax router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = router
    if router.api_key:
        from sgjax.server.app import OPEN_ROUTES, ApiKey

        app.add_middleware(ApiKey, key=router.api_key, open_routes=OPEN_ROUTES)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        return JSONResponse(
            ApiError(f"{request.url.path}: {e.detail}", status=e.status_code).body(), status_code=e.status_code
        )

    async def generation(request: Request):
        body = await request.body()
        call = router.forward(request.url.path, body, request.headers.get("content-type"))
        try:
            return await until_disconnected(request.receive, call)
        except ClientDisconnected:
            return Response(status_code=499)  # to nobody: the client is gone

    for path in GENERATION_ROUTES:
        app.add_api_route(path, generation, methods=["POST"])

    @app.get("/v1/models")
    async def models():
        return await router.get_any("/v1/models")

    @app.get("/get_model_info")
    @app.get("/model_info")  # SGLang's newer names, which sglang-router asks first
    async def model_info():
        return await router.get_any("/get_model_info")

    @app.get("/health_generate")
    async def health_generate():
        return await router.get_any("/health_generate")

    @app.get("/health")
    async def health():
        await router.probe_all()
        if any(w.healthy for w in router.workers.values()):
            return Response(status_code=200)
        raise ApiError(router.none_left({}), status=503, kind="unavailable")

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info():
        answers = await router.broadcast("GET", "/get_server_info")
        workers, totals = [], dict.fromkeys(_SUMMED, 0)
        for w in router.workers.values():
            entry = {"url": w.url, "healthy": w.healthy}
            r = answers.get(w.url)
            if isinstance(r, httpx.Response) and r.status_code == 200:
                entry["info"] = info = r.json()
                for k in _SUMMED:
                    totals[k] += info.get(k) or 0
            else:
                entry["error"] = r if isinstance(r, str) else _describe(r) if r is not None else w.last_error
            workers.append(entry)
        hit = totals["cached_tokens"] / totals["prompt_tokens"] if totals["prompt_tokens"] else 0.0
        return {
            **totals,
            **_layout([e["info"] for e in workers if "info" in e], len(workers)),
            "cache_hit_rate": hit,
            "healthy_workers": sum(w.healthy for w in router.workers.values()),
            "num_workers": len(router.workers),
            "router": router.router_info(),
            "workers": workers,
        }

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request):
        answers = await router.broadcast(request.method, "/flush_cache")
        if not answers:
            raise ApiError(router.none_left({}), status=503, kind="unavailable")
        failed = {}
        for url, r in answers.items():
            if isinstance(r, httpx.Response) and r.status_code == 200:
                router.policy.forget(url)  # that worker's cache is empty now
            else:
                failed[url] = r
        if failed:
            status = next((r.status_code for r in failed.values() if isinstance(r, httpx.Response)), 503)
            detail = "; ".join(f"{u}: {r if isinstance(r, str) else _describe(r)}" for u, r in failed.items())
            raise ApiError(
                f"flush_cache: refused by {len(failed)} of {len(answers)} workers: {detail}",
                status=status,
                kind="unavailable" if status == 503 else "invalid_request_error",
            )
        router.policy.clear()
        return {"success": True, "message": f"Cache flushed on {len(answers)} workers."}

    @app.post("/abort_request")
    async def abort_request(request: Request):
        # The router does not track rids: every worker gets the abort; the one running the request stops it.
        body = await request.body()
        answers = await router.broadcast("POST", "/abort_request", body, request.headers.get("content-type"))
        for r in answers.values():
            if isinstance(r, httpx.Response) and r.status_code != 200:
                return Response(r.content, status_code=r.status_code, media_type="application/json")
        return {"success": True}

    return app


def _layout(infos: list[dict], num_workers: int) -> dict:
    """The fleet as one server's keys: dp_size is the workers (sglang-router --dp-aware reads it: rank r of a request
    is worker r), and tp_size / nnodes / mesh_shape and the model's names are theirs when every answering worker
    agrees (None when they differ or none answered: a router in front of unlike servers has no one layout)."""
    out = {"dp_size": num_workers}
    for key in ("tp_size", "nnodes", "mesh_shape", "model_path", "served_model_name"):
        values = [i.get(key) for i in infos]
        out[key] = values[0] if values and all(v == values[0] for v in values) else None
    return out


def _describe(r: httpx.Response) -> str:
    try:
        return f"{r.status_code} {r.json()['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"{r.status_code} {r.text[:200]}"
