"""A timeline of the engine's steps, for benchmarks: when each step was dispatched, when its outputs were ready on
the device, and what it held. Off by default (`Engine.step_log` is None); a benchmark sets a list.

From the timeline, with the device running one step at a time in dispatch order:
- step k's device time runs from max(its dispatch, step k-1 ready) to its ready time;
- the device is idle between steps when step k was dispatched after step k-1 was ready (the host had not yet
  scheduled it): that gap is the overlap loop's target.
The ready time is taken by a watcher thread blocked on the step's sampled tokens, so it lags the device by a GIL
hand-off (the engine asks for a 0.5 ms switch interval); dispatch is taken when the call returned, after the launch.
Both biases make idle time look larger, never smaller.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass


@dataclass
class StepRecord:
    kind: str  # "decode" (every row one token), "prefill" (no decode row) or "mixed"
    requests: int
    tokens: int  # new tokens in the step (unpadded)
    kv_tokens: int  # context the step's attention reads: the sum of the requests' kv lengths
    decode_rows: int
    started: float  # perf_counter before dispatch
    dispatched: float  # perf_counter when dispatch returned
    overlapped: bool = False
    ready: float | None = None


def record_of(works, started: float, dispatched: float) -> StepRecord:
    decode = sum(1 for w in works if len(w.tokens) == 1 and w.sample)
    tokens = sum(len(w.tokens) for w in works)
    kind = "decode" if decode == len(works) else ("prefill" if decode == 0 else "mixed")
    return StepRecord(
        kind=kind,
        requests=len(works),
        tokens=tokens,
        kv_tokens=sum(w.start + len(w.tokens) for w in works),
        decode_rows=decode,
        started=started,
        dispatched=dispatched,
    )


class StepWatcher:
    """Sets each record's `ready` when its step's output array is ready on the device (one daemon thread)."""

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="sgjax-step-watcher", daemon=True)
        self._thread.start()

    def watch(self, record: StepRecord, array) -> None:
        self._queue.put((record, array))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            record, array = item
            try:
                array.block_until_ready()
            except Exception:  # noqa: BLE001 - a failed step: the engine reports it; the timeline skips it
                continue
            record.ready = time.perf_counter()


def summarize(
    records: list[StepRecord],
    weight_bytes: int | None = None,
    kv_bytes_per_token: int | None = None,
    bandwidth: float | None = None,
    min_decode_rows: int = 1,
) -> dict:
    """Device busy and idle time over the timeline, per step kind; with the roofline terms, the decode steps'
    ideal time (weights + KV read once, over the bandwidth) against their device time."""
    done = sorted((r for r in records if r.ready is not None), key=lambda r: r.dispatched)
    if not done:
        return {"steps": 0}
    busy = {"decode": 0.0, "prefill": 0.0, "mixed": 0.0}
    idle, prev_ready = 0.0, None
    ideal = roof_device = 0.0
    roof_steps = 0
    for r in done:
        start = r.dispatched if prev_ready is None else max(r.dispatched, prev_ready)
        if prev_ready is not None:
            idle += max(0.0, r.dispatched - prev_ready)
        device = max(r.ready - start, 0.0)
        busy[r.kind] += device
        if (
            bandwidth
            and r.kind == "decode"
            and r.decode_rows >= min_decode_rows
            and weight_bytes is not None
            and kv_bytes_per_token is not None
        ):
            ideal += (weight_bytes + r.kv_tokens * kv_bytes_per_token) / bandwidth
            roof_device += device
            roof_steps += 1
        prev_ready = r.ready if prev_ready is None else max(prev_ready, r.ready)
    span = prev_ready - done[0].dispatched
    out = {
        "steps": len(done),
        "span_s": span,
        "idle_s": idle,
        "idle_share": idle / span if span > 0 else 0.0,
        **{f"{k}_busy_s": v for k, v in busy.items()},
        **{f"{k}_steps": sum(1 for r in done if r.kind == k) for k in busy},
        "overlapped_steps": sum(1 for r in done if r.overlapped),
    }
    if roof_steps:
        out.update(
            decode_roof_steps=roof_steps,
            decode_ideal_s=ideal,
            decode_device_s=roof_device,
            decode_roofline_ratio=ideal / roof_device if roof_device > 0 else None,
            decode_ms_per_step=1e3 * roof_device / roof_steps,
        )
    return out
