"""`HttpArgs`: the HTTP server's own settings (the engine's are `ServerArgs`), and their `sgjax serve` flags."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HttpArgs:
    host: str = "127.0.0.1"
    port: int = 30000
    served_model_name: str | None = None
    enable_metrics: bool = False
    log_requests: bool = False
    log_level: str = "info"
    skip_server_warmup: bool = False
    api_key: str | None = None  # every route but /health and /ready then needs `Authorization: Bearer <key>`
    stream_interval: int = 1  # streamed chunks carry at least this many new tokens (the last one: what is left)
    max_queued_requests: int | None = None  # generations waiting beyond the running batch; more get a 503
    profile_dir: str | None = None  # where /start_profile writes JAX profiler traces (default: a temp dir)
    request_timeout: float | None = None  # seconds a generation request may take; then 504 (a stream: an error event)
    # The chat routes' output parsers (server/tool_parsers.py, server/reasoning.py). tool_call_parser None: the
    # format the chat template writes (hermes when it shows none); reasoning_parser None: no reasoning split.
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    disable_tool_call_constraint: bool = False  # the ablation: calls are parsed, but decoded without their grammar
    header_timeout: float = (
        10.0  # seconds a request line and its headers may take to arrive; then the connection closes
    )


def _choices():
    from sgjax.server.reasoning import NAMES
    from sgjax.server.tool_parsers import PARSERS

    return sorted(PARSERS), list(NAMES)


_TOOL_PARSERS, _REASONING_PARSERS = _choices()

HTTP_FLAGS = [
    ("host", dict(help="address to listen on (loopback by default: expose it on purpose)")),
    ("port", dict(type=int, help="port to listen on")),
    ("served_model_name", dict(help="model name in the OpenAI API (default: the model file's name)")),
    ("enable_metrics", dict(action="store_true", help="serve Prometheus metrics at /metrics")),
    ("log_requests", dict(action="store_true", help="log every request's inputs, outputs and HTTP access lines")),
    ("log_level", dict(choices=["debug", "info", "warning", "error"], help="logging level")),
    ("skip_server_warmup", dict(action="store_true", help="skip the warm-up request before listening")),
    (
        "api_key",
        dict(help="require `Authorization: Bearer <key>` on every route but /health and /ready (401 otherwise)"),
    ),
    ("stream_interval", dict(type=int, help="tokens per streamed chunk, at least (the last chunk: what is left)")),
    (
        "max_queued_requests",
        dict(
            type=int, help="generations that may wait beyond the running batch; more are answered 503 with Retry-After"
        ),
    ),
    ("profile_dir", dict(help="directory of the JAX profiler traces that POST /start_profile starts")),
    (
        "request_timeout",
        dict(
            type=float, help="seconds a generation may take; then it is aborted: a 504, or an error event on a stream"
        ),
    ),
    (
        "header_timeout",
        dict(
            type=float,
            help="seconds a request's line and headers may take to arrive; then the "
            "connection is closed (slow clients hold no worker)",
        ),
    ),
    (
        "tool_call_parser",
        dict(
            choices=_TOOL_PARSERS,
            help="format of the model's tool calls on /v1/chat/completions "
            "(default: the chat template's own, hermes when it shows "
            "none)",
        ),
    ),
    (
        "reasoning_parser",
        dict(
            choices=_REASONING_PARSERS,
            help="split the chat answers' <think>...</think> reasoning into reasoning_content (SGLang's model types)",
        ),
    ),
    (
        "disable_tool_call_constraint",
        dict(
            action="store_true",
            help="decode tool calls without their grammar (they are still parsed): the ablation of the constraint",
        ),
    ),
]
