"""The step timeline benchmarks read (sgjax/engine/steplog.py): busy and idle arithmetic, and the engine filling it."""

import numpy as np

from sgjax.engine.engine import Engine
from sgjax.engine.steplog import StepRecord, summarize
from sgjax.model.presets import MICRO_LLAMA
from sgjax.model.weights import dummy_weights


def rec(kind, dispatched, ready, rows=4, kv=100):
    return StepRecord(
        kind=kind,
        requests=rows,
        tokens=rows,
        kv_tokens=kv,
        decode_rows=rows if kind == "decode" else 0,
        started=dispatched,
        dispatched=dispatched,
        ready=ready,
    )


def test_summarize_busy_idle_and_decode_roofline():
    # step 2 is dispatched 1 s after step 1 is ready (idle); step 3 is queued while step 2 runs (no idle)
    steps = [rec("prefill", 0.0, 2.0), rec("decode", 3.0, 4.0), rec("decode", 3.5, 6.0)]
    s = summarize(steps, weight_bytes=100, kv_bytes_per_token=1, bandwidth=100.0, min_decode_rows=4)
    assert s["steps"] == 3 and s["span_s"] == 6.0
    assert s["idle_s"] == 1.0 and abs(s["idle_share"] - 1 / 6) < 1e-12
    assert s["prefill_busy_s"] == 2.0 and s["decode_busy_s"] == 3.0  # 3 -> 4, then 4 -> 6
    assert s["decode_roof_steps"] == 2 and abs(s["decode_ideal_s"] - 4.0) < 1e-12  # (100 + 100) / 100 each
    assert abs(s["decode_roofline_ratio"] - 4.0 / 3.0) < 1e-12
    assert "decode_roof_steps" not in summarize(steps, 100, 1, 100.0, min_decode_rows=5)
    assert summarize([rec("decode", 0.0, None)]) == {"steps": 0}


def test_engine_records_every_step():
    with Engine.from_weights(
        MICRO_LLAMA, dummy_weights(MICRO_LLAMA), max_running_requests=4, max_total_tokens=512
    ) as eng:
        eng.step_log = []
        prompts = [list(np.arange(1, 9 + i)) for i in range(3)]
        eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 5, "temperature": 0, "ignore_eos": True})
        steps = eng.get_server_info()["steps"]
        log = eng.step_log
    assert len(log) == steps and steps >= 5
    assert log[0].kind == "prefill" and log[0].tokens == sum(map(len, prompts))
    assert [r.kind for r in log[1:]] == ["decode"] * (steps - 1)
    assert all(r.ready is not None and r.ready >= r.dispatched >= r.started for r in log)
    assert all(r.overlapped for r in log)  # the prefill too: the first decode step reads its tokens on the device
    assert summarize(log)["steps"] == steps
