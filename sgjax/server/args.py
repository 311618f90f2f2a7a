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


HTTP_FLAGS = [
    ("host", dict(help="address to listen on (loopback by default: expose it on purpose)")),
    ("port", dict(type=int, help="port to listen on")),
    ("served_model_name", dict(help="model name in the OpenAI API (default: the model file's name)")),
    ("enable_metrics", dict(action="store_true", help="serve Prometheus metrics at /metrics")),
    ("log_requests", dict(action="store_true", help="log every request's inputs, outputs and HTTP access lines")),
    ("log_level", dict(choices=["debug", "info", "warning", "error"], help="logging level")),
    ("skip_server_warmup", dict(action="store_true", help="skip the warm-up request before listening")),
]
