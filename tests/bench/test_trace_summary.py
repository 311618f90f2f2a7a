"""scripts/perf/trace_summary.py reads the profiler's own trace file: busy time within the span, ops and host marks."""

import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "perf"))
from trace_summary import _union, summarize_trace  # noqa: E402


def test_union_of_overlapping_intervals():
    assert _union([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4


def test_summary_of_a_real_trace(tmp_path):
    f = jax.jit(lambda a: (a @ a).sum())
    a = jnp.ones((256, 256))
    f(a).block_until_ready()
    jax.profiler.start_trace(str(tmp_path))
    with jax.profiler.TraceAnnotation("sgjax.dispatch"):
        for _ in range(3):
            f(a).block_until_ready()
    jax.profiler.stop_trace()
    s = summarize_trace(str(tmp_path))
    assert s["ops"] > 0 and 0 < s["busy_ms"] <= s["span_ms"] + 1e-9 and 0 <= s["idle_share"] < 1
    assert s["top_ops"] and s["host_ms"]["sgjax.dispatch"] > 0
