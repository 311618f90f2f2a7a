"""The HTTP layer's side of the engine: one `HttpWork` per HTTP request, run whole or streamed, aborted when the client
leaves, engine errors turned into `ApiError`s that name the API's field.

Runs on the event loop. The engine validates, tokenizes and compiles grammars in a worker thread
(`Engine.async_generate`) and steps in its own thread; here only results are reshaped, so a busy engine never delays
/health.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from sgjax.engine.engine import Engine
from sgjax.engine.images import ImageDataError
from sgjax.engine.params import SamplingParams, SamplingParamsError
from sgjax.engine.requests import GenerateCall, copy_rid, copy_seed
from sgjax.errors import CLIENT, SHUTDOWN, EngineError, RequestError, SgjaxError
from sgjax.fsm import from_tokenizer
from sgjax.server.args import HttpArgs
from sgjax.server.connection import until_disconnected
from sgjax.server.metrics import Metrics
from sgjax.server.protocol import ApiError
from sgjax.server.reasoning import ReasoningParser
from sgjax.server.tool_parsers import default_parser_name, get_parser

log = logging.getLogger("sgjax.server")

MAX_SUBREQUESTS = 1024  # prompts x n in one HTTP request


@dataclass(frozen=True)
class HttpWork:
    """What one HTTP request asks of the engine: prompts (text or ids), one validated SamplingParams per prompt, and
    each prompt's images (base64, one image token each in the prompt) with the API fields they came from."""

    params: tuple[SamplingParams, ...]
    texts: tuple[str, ...] | None = None
    ids: tuple[list[int], ...] | None = None
    rids: tuple[str, ...] | None = None
    return_logprob: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    prompt_field: str = "text"  # the API's names, for error messages
    params_field: str = ""  # prefix for sampling-parameter errors ("sampling_params" on /generate)
    renames: dict = field(default_factory=dict)  # engine name -> API name ("max_new_tokens" -> "max_tokens")
    images: tuple[tuple[str, ...] | None, ...] | None = None  # per prompt: its images, or None
    # per prompt: (the API field of its images as a whole, the field of each image), so that an engine error about
    # image k of prompt i names what the client sent ("image_data.1.0", "messages.0.content.2.image_url.url")
    image_fields: tuple[tuple[str, tuple[str, ...]], ...] | None = None
    loras: tuple[str | None, ...] | None = None  # per prompt: its LoRA adapter's name, or None (the base model)
    bootstraps: tuple | None = None  # per prompt: (prefill host, bootstrap port, room) under disaggregation, or None

    @property
    def prompts(self):
        return self.texts if self.texts is not None else self.ids

    @property
    def has_images(self) -> bool:
        return self.images is not None and any(i is not None for i in self.images)

    def call(self) -> GenerateCall:
        """The whole work as one engine call: every prompt, with n copies of each (the engine makes them)."""
        return self._call(
            list(self.prompts),
            list(self.params),
            list(self.rids) if self.rids else None,
            list(self.images) if self.has_images else None,
            stream=False,
            loras=list(self.loras) if self.loras else None,
            bootstraps=list(self.bootstraps) if self.bootstraps else None,
        )

    def copy_call(self, prompt: int, params: SamplingParams, rid: str | None) -> GenerateCall:
        """One streamed copy of prompt `prompt` (the engine streams one request at a time)."""
        images = self.images[prompt] if self.images else None
        return self._call(
            self.prompts[prompt],
            params,
            rid,
            images,
            stream=True,
            loras=self.loras[prompt] if self.loras else None,
            bootstraps=[self.bootstraps[prompt]] if self.bootstraps else None,
        )

    def _call(self, prompts, params, rid, images, stream: bool, loras=None, bootstraps=None) -> GenerateCall:
        text = self.texts is not None
        return GenerateCall(
            prompt=prompts if text else None,
            input_ids=None if text else prompts,
            sampling_params=params,
            return_logprob=self.return_logprob,
            logprob_start_len=self.logprob_start_len,
            top_logprobs_num=self.top_logprobs_num,
            stream=stream,
            rid=rid,
            image_data=images,
            lora_path=loras,
            bootstrap=bootstraps,
        )

    def image_field(self, prompt: int | None, image: int | None = None) -> str:
        if self.image_fields is None or prompt is None:
            return "image_data"
        whole, each = self.image_fields[prompt]
        return each[image] if image is not None and image < len(each) else whole


class Serving:
    def __init__(self, engine: Engine, http: HttpArgs):
        self.engine, self.http = engine, http
        self.tokenizer = engine.tokenizer
        self.metrics = Metrics()
        engine.on_step = self.metrics.step_time.observe
        self.profiler = Profiler(http.profile_dir)
        path = engine.args.model_path or _default_path()
        self.model_path = path
        self.model_name = http.served_model_name or os.path.basename(path.rstrip("/")).removesuffix(".gguf")
        self._stopper: threading.Thread | None = None
        # generations admitted whose engine call has not started yet (it starts in wait_for's task, a loop turn
        # later): counted as queued, or a burst of handlers would all pass --max-queued-requests before any starts
        self._admitted = 0
        self._vocab = from_tokenizer(self.tokenizer) if self.tokenizer is not None else None
        self._pieces: dict[int, tuple[str, bytes]] = {}
        # What a chat message's image part becomes in the templated text: the model's own image token (LLaVA's
        # "<image>"), which the engine expands to the tower's rows. None: a text-only model.
        vision = engine.images
        self.image_token = (
            self.tokenizer.hf.id_to_token(vision.cfg.image_token_index)
            if vision is not None and self.tokenizer is not None
            else None
        )
        # The chat routes' output parsers: the tool-call format (by flag, else the one the template writes) and
        # the reasoning split (by flag only: a model that does not think has no <think> block to split).
        template = self.tokenizer.chat_template if self.tokenizer is not None else None
        self.tool_format = get_parser(http.tool_call_parser or default_parser_name(template))
        self.reasoning = ReasoningParser.named(http.reasoning_parser) if http.reasoning_parser else None

    # -- life cycle ------------------------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self._stopper is None and self.engine.alive

    def begin_shutdown(self) -> None:
        """From the signal handler: stop the engine in the background. Its loop finishes every request with an
        abort, so open streams end now and the HTTP server's graceful shutdown does not wait for them."""
        if self._stopper is None:
            self._stopper = threading.Thread(target=self.engine.shutdown, name="sgjax-shutdown")
            self._stopper.start()

    def finish_shutdown(self) -> None:
        self.begin_shutdown()
        self._stopper.join()

    @property
    def token_limit(self) -> int:
        """A prompt plus its output must fit both the context and the KV pool."""
        return min(self.engine.context_length, self.engine.max_total_tokens)

    # -- running work ----------------------------------------------------------------------------------------
    async def run(self, work: HttpWork, receive) -> list[dict]:
        """All prompts x n copies in one engine call (every prompt is validated before any is queued); the flat
        list of results, prompt-major. Aborted when the client disconnects."""
        self._check(work)
        release = self._admit(work)
        try:
            call = self.engine.async_run(work.call())
            self._log_start(work)

            async def started():
                release()  # the engine's own count (calls being tokenized) takes over in this same loop turn
                return await call

            results = await asyncio.wait_for(
                until_disconnected(receive, self._engine_errors(started(), work)), self.http.request_timeout
            )
        except TimeoutError:  # wait_for cancelled the call, and a cancelled engine call aborts its requests
            raise self._timeout() from None
        finally:
            release()
        results = results if isinstance(results, list) else [results]
        _raise_if_failed(results)
        self._log_end(results)
        return results

    async def open_streams(self, work: HttpWork) -> list[AsyncIterator[dict]]:
        """One engine stream per prompt x copy (the engine streams one request at a time), all validated before
        any is queued: an engine stream starts when first iterated. Copy j of a seeded prompt gets seed + j, as
        the engine's own n does."""
        self._check(work)
        self._admit(work)()  # the first stream's call starts within this loop turn: its own count takes over
        streams = await self._open(work)
        self._log_start(work)
        return streams

    async def _open(self, work: HttpWork) -> list[AsyncIterator[dict]]:
        streams = []
        for i, params in enumerate(work.params):
            base = work.rids[i] if work.rids else None
            for j in range(params.n):
                copy = dataclasses.replace(params, n=1, seed=copy_seed(params, j))
                call = self.engine.async_run(work.copy_call(i, copy, copy_rid(base, params, j)))
                streams.append(await self._engine_errors(call, work, i))
        return streams

    async def merge(self, streams: list[AsyncIterator[dict]]) -> AsyncIterator[tuple[int, dict]]:
        """(index, chunk) from all streams as they come. Leaving early (a disconnect cancels the consumer)
        cancels every stream, and each one aborts its engine request."""
        queue: asyncio.Queue = asyncio.Queue()
        start = time.perf_counter()
        interval = max(self.http.stream_interval, 1)

        async def pump(index: int, stream):
            try:
                sent = None  # completion tokens in the last chunk passed on
                async for item in stream:
                    meta = item["meta_info"]
                    if sent is None:
                        self.metrics.ttft.observe(time.perf_counter() - start)
                    elif meta["finish_reason"] is None and meta["completion_tokens"] - sent < interval:
                        continue  # --stream-interval: the first chunk at once, then every `interval` tokens
                    sent = meta["completion_tokens"]
                    queue.put_nowait((index, item))
                queue.put_nowait((index, None))
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait((index, e))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        deadline = None if self.http.request_timeout is None else start + self.http.request_timeout
        try:
            open_ = len(tasks)
            while open_:
                try:
                    index, item = await asyncio.wait_for(
                        queue.get(), None if deadline is None else max(deadline - time.perf_counter(), 0)
                    )
                except TimeoutError:  # the finally below cancels the streams, which aborts their requests
                    raise self._timeout() from None
                if item is None:
                    open_ -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    if item["meta_info"]["finish_reason"] is not None:
                        self._log_end([item])
                    yield index, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _timeout(self) -> ApiError:
        return ApiError(
            f"request: longer than {self.http.request_timeout:g} s (request_timeout); aborted",
            status=504,
            kind="timeout",
            code="request_timeout",
        )

    def _admit(self, work: HttpWork):
        """--max-queued-requests: a 503 with Retry-After when that many generations already wait for the running
        batch (the scheduler's waiting list, the engine's inbox and calls being tokenized, read without stopping the
        engine, plus the calls admitted here that have not started). Returns the admission's release (idempotent),
        to call once the engine call has started or will not."""
        cap = self.http.max_queued_requests
        waiting = self.engine.queued_requests() + self._admitted
        if cap is not None and waiting >= cap:  # SGLang's rule: refused once that many wait
            raise ApiError(
                f"server: {waiting} generations are waiting (max_queued_requests {cap}); retry later",
                status=503,
                kind="unavailable",
                code="server_busy",
                headers={"Retry-After": "1"},
            )
        self._admitted += 1
        held = True

        def release():
            nonlocal held
            if held:
                held = False
                self._admitted -= 1

        return release

    def _check(self, work: HttpWork) -> None:
        total = sum(p.n for p in work.params)
        if total > MAX_SUBREQUESTS:
            raise ApiError(
                f"{work.prompt_field}: {total} generations (prompts x n) in one request; at most {MAX_SUBREQUESTS}",
                param=work.prompt_field,
            )
        if work.has_images and self.engine.images is None:
            where = work.image_field(next(i for i, x in enumerate(work.images) if x is not None))
            raise ApiError(
                f"{where}: this server's model is text-only; images need a vision-language model (sgjax "
                f"serve --model-path <a LLaVA checkpoint directory>)",
                param=where,
            )

    async def _engine_errors(self, call, work: HttpWork, prompt: int | None = None):
        try:
            return await call
        except ImageDataError as e:  # the engine counts prompts in its own call; a stream's call has one
            where = work.image_field(e.prompt if e.prompt is not None else prompt, e.image)
            raise ApiError(f"{where}: {e.reason}", param=where) from None
        except SgjaxError as e:
            if e.kind == SHUTDOWN:
                raise ApiError(str(e), status=503, kind="unavailable") from None
            if e.kind != CLIENT:
                raise
            if isinstance(e, SamplingParamsError):
                raise params_error(e, work.params_field, work.renames) from None
            raise params_error(e, renames={"prompt": work.prompt_field}) from None

    # -- helpers for the APIs --------------------------------------------------------------------------------
    async def info(self) -> dict:
        """The engine's server info, read between steps on the engine thread (a worker thread waits for it)."""
        try:
            return await asyncio.to_thread(self.engine.get_server_info)
        except EngineError as e:
            raise ApiError(str(e), status=503, kind="unavailable") from None

    def token_piece(self, token_id: int) -> tuple[str, bytes]:
        """A token's own bytes and their text (U+FFFD where it holds part of a UTF-8 character): logprob entries."""
        piece = self._pieces.get(token_id)
        if piece is None:
            vocab = self._vocab.tokens if self._vocab is not None else ()
            raw = vocab[token_id] if 0 <= token_id < len(vocab) else None
            if raw is None:  # special tokens have no bytes in the FSM's vocabulary: their spelled-out text
                text = self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer else ""
                piece = (text, text.encode())
            else:
                piece = (raw.decode("utf-8", errors="replace"), raw)
            self._pieces[token_id] = piece
        return piece

    def _log_start(self, work: HttpWork) -> None:
        if self.http.log_requests:
            prompts = [_clip(p) if isinstance(p, str) else f"<{len(p)} ids>" for p in work.prompts]
            params = [
                {f.name: getattr(p, f.name) for f in dataclasses.fields(p) if getattr(p, f.name) != f.default}
                for p in work.params
            ]  # what the request changed
            log.info("request rids=%s prompts=%s params=%s", list(work.rids) if work.rids else None, prompts, params)

    def _log_end(self, results: list[dict]) -> None:
        if self.http.log_requests:
            for r in results:
                m = r["meta_info"]
                log.info(
                    "finish rid=%s reason=%s prompt=%d completion=%d cached=%d text=%s",
                    m["id"],
                    m["finish_reason"],
                    m["prompt_tokens"],
                    m["completion_tokens"],
                    m["cached_tokens"],
                    _clip(r["text"]),
                )


def params_error(e: RequestError, prefix: str = "", renames: dict | None = None) -> ApiError:
    """The API's view of an engine error about a field: "field: reason", the field renamed to the API's
    ("max_new_tokens" -> "max_tokens", "prompt" -> "messages") and, on /generate, under "sampling_params"."""
    name = (renames or {}).get(e.field, e.field) if e.field else None
    if name is None:
        return ApiError(f"{prefix}: {e}" if prefix else str(e), param=prefix or None)
    param = f"{prefix}.{name}" if prefix else name
    return ApiError(f"{param}: {e.reason}", param=param)


def _raise_if_failed(results: list[dict]) -> None:
    """An engine-side abort that carries a message (shut down, a failed step) is the answer's error, with the status
    the engine gave it; a plain abort (/abort_request) is a result."""
    for r in results:
        reason = r["meta_info"]["finish_reason"] or {}
        if reason.get("type") == "abort" and reason.get("message"):
            status = reason.get("status_code", 500)
            kind = {503: "unavailable", 400: "invalid_request_error"}.get(status, "server_error")
            raise ApiError(reason["message"], status=status, kind=kind)


def _clip(text: str, n: int = 200) -> str:
    return text if len(text) <= n else text[:n] + "..."


def _default_path() -> str:
    from sgjax.model.paths import default_model_path

    return default_model_path()


class Profiler:
    """POST /start_profile and /stop_profile (SGLang's routes): a JAX profiler trace of everything in between, in
    --profile-dir or a fresh temporary directory; scripts/perf/trace_summary.py reads it."""

    def __init__(self, directory: str | None):
        self.directory, self.active = directory, None
        self._lock = threading.Lock()

    def start(self) -> dict:
        import tempfile

        import jax

        with self._lock:
            if self.active is not None:
                raise ApiError(f"profile: already running, into {self.active}", param="profile")
            out = self.directory or tempfile.mkdtemp(prefix="sgjax-profile-")
            jax.profiler.start_trace(out)
            self.active = out
        return {"success": True, "message": f"profiling into {out}", "output_dir": out}

    def stop(self) -> dict:
        import jax

        with self._lock:
            if self.active is None:
                raise ApiError("profile: not running (POST /start_profile first)", param="profile")
            jax.profiler.stop_trace()
            out, self.active = self.active, None
        return {"success": True, "message": f"trace written under {out}", "output_dir": out}


def bootstrap_rooms(req, single: bool, count: int):
    """Prefill/decode disaggregation's (host, port, room) per prompt, None without a room: sglang-router sends
    lists for a batch on /generate (`single`: one prompt, or an OpenAI request, where a list is refused)."""
    fields = (req.bootstrap_host, req.bootstrap_port, req.bootstrap_room)
    if req.bootstrap_room is None:
        return None
    columns = []
    for name, value in zip(("bootstrap_host", "bootstrap_port", "bootstrap_room"), fields):
        if isinstance(value, list):
            if single or len(value) != count:
                raise ApiError(f"{name}: a list takes one entry per prompt ({count})", param=name)
            columns.append(value)
        else:
            columns.append([value] * count)
    out = tuple(zip(*columns))
    if any(host is None or port is None for host, port, _ in out):
        raise ApiError(
            "bootstrap_host: a bootstrap_room needs the prefill worker's host and port", param="bootstrap_host"
        )
    return out
