"""/metrics in Prometheus' text exposition format (version 0.0.4), names prefixed `sgjax:`.

Token counters, queue length, running requests, pool usage and the cache hit rate come from the engine's server info
(read between steps, so they are consistent with each other); request counts and latencies are observed here by
the HTTP layer; step times arrive from the engine thread through `Engine.on_step`. Written by hand: the format is a
few lines of text and the server then needs no metrics library.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections import Counter

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Histogram:
    """Cumulative-bucket histogram; `observe` may be called from any thread (the engine's included)."""

    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self._counts = [0] * (len(self.buckets) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        with self._lock:
            self._counts[i] += 1
            self._sum += value

    def snapshot(self) -> tuple[list[int], float]:
        with self._lock:
            return list(self._counts), self._sum


class Metrics:
    def __init__(self):
        self.requests: Counter = Counter()  # (endpoint, status code) -> count
        self.step_time = Histogram(STEP_BUCKETS)
        self.e2e_latency = Histogram(LATENCY_BUCKETS)
        self.ttft = Histogram(LATENCY_BUCKETS)
        self._lock = threading.Lock()

    def count_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def render(self, info: dict) -> str:
        """The exposition text; `info` is the engine's get_server_info()."""
        out: list[str] = []
        with self._lock:
            requests = sorted(self.requests.items())
        _family(
            out,
            "num_requests_total",
            "counter",
            "HTTP requests answered, by endpoint and status code",
            [({"endpoint": e, "status": str(s)}, n) for (e, s), n in requests],
        )
        for name, key, help_ in (
            ("prompt_tokens_total", "prompt_tokens", "Prompt tokens of admitted requests"),
            ("generation_tokens_total", "generated_tokens", "Output tokens generated"),
            ("cached_tokens_total", "cached_tokens", "Prompt tokens served from the prefix cache"),
            ("num_retractions_total", "retractions", "Requests retracted under memory pressure"),
            ("spec_verify_rows_total", "spec_rows", "Decoding rows that verified a draft (speculative decoding)"),
            ("spec_draft_tokens_total", "spec_drafted_tokens", "Tokens drafted (speculative decoding)"),
            ("spec_accepted_tokens_total", "spec_accepted_tokens", "Drafted tokens accepted by verification"),
        ):
            _family(out, name, "counter", help_, [({}, info[key])])
        if info.get("spec_accept_length") is not None:  # SGLang's gauge: tokens a verifying row adds per step
            _family(
                out,
                "spec_accept_length",
                "gauge",
                "Accepted drafted tokens + 1 per verify row",
                [({}, info["spec_accept_length"])],
            )
        for name, key, help_ in (
            ("num_running_reqs", "running_requests", "Requests in the running batch"),
            ("num_queue_reqs", "waiting_requests", "Requests waiting to be admitted"),
            ("token_usage", "pool_usage", "Fraction of KV pool pages in use (cache included)"),
            ("cache_hit_rate", "cache_hit_rate", "Cached / prompt tokens since start"),
        ):
            _family(out, name, "gauge", help_, [({}, info[key])])
        if "expert_tokens" in info:  # a mixture of experts: per expert over the layers, and each layer's imbalance
            counts = info["expert_tokens"]
            per_expert = [sum(col) for col in zip(*counts)]
            _family(
                out,
                "moe_expert_tokens_total",
                "counter",
                "Tokens routed to each expert, summed over the layers "
                "(a token counts once per layer and per expert it picks)",
                [({"expert": str(e)}, n) for e, n in enumerate(per_expert)],
            )
            _family(
                out,
                "moe_layer_imbalance",
                "gauge",
                "Per layer: the busiest expert's tokens / the mean (1 is balanced)",
                [
                    ({"layer": str(i)}, max(row) * len(row) / sum(row) if sum(row) else 1.0)
                    for i, row in enumerate(counts)
                ],
            )
        _histogram(out, "step_time_seconds", "Time of one engine step (batch build, forward, sampling)", self.step_time)
        _histogram(
            out, "e2e_request_latency_seconds", "Generation requests from body read to last byte", self.e2e_latency
        )
        _histogram(out, "time_to_first_token_seconds", "Streams: request to first chunk", self.ttft)
        return "\n".join(out) + "\n"


def _family(out: list[str], name: str, kind: str, help_: str, samples) -> None:
    out.append(f"# HELP sgjax:{name} {help_}")
    out.append(f"# TYPE sgjax:{name} {kind}")
    for labels, value in samples:
        out.append(f"sgjax:{name}{_labels(labels)} {_number(value)}")


def _histogram(out: list[str], name: str, help_: str, hist: Histogram) -> None:
    counts, total = hist.snapshot()
    out.append(f"# HELP sgjax:{name} {help_}")
    out.append(f"# TYPE sgjax:{name} histogram")
    running = 0
    for bound, n in zip(hist.buckets + (math.inf,), counts):
        running += n
        out.append(f"sgjax:{name}_bucket{_labels({'le': _number(bound)})} {running}")
    out.append(f"sgjax:{name}_sum {_number(total)}")
    out.append(f"sgjax:{name}_count {running}")


def _labels(labels: dict) -> str:
    if not labels:
        return ""
    esc = lambda v: str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")  # noqa: E731
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in labels.items()) + "}"


def _number(value) -> str:
    if value == math.inf:
        return "+Inf"
    if isinstance(value, float):
        return repr(value)
    return str(int(value))
