"""The paper's benchmark programs end to end (`scripts/bench/run.py --quick`): the CI smoke test.

It runs the real CLI in a subprocess with the HF baseline, then checks what the numbers must satisfy whatever the
machine's speed: every workload ran under every configuration, hit rates never beat the Theorem 3.1 optimum, the
cache hits where programs share prefixes, constrained decoding always gives valid JSON, and greedy sgjax agrees
with HF transformers program by program on the labelled workloads.

Two runs, the same checks:
- `smoke` (every CI run): three workloads (few-shot gen, select, regex fields) on the tiny random model with
  SmolLM2's tokenizer (`--dummy tiny`); HF gets the same random weights, so agreement is still exact.
- `full` (marked slow: `pytest -m slow tests/bench`): all ten workloads on the real SmolLM2, about 6 minutes on
  2 cores.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import SMALL

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKLOADS = {
    "mmlu",
    "hellaswag",
    "tree_of_thought",
    "skeleton_of_thought",
    "llm_judge",
    "json_decode",
    "multi_turn_short",
    "multi_turn_long",
    "react",
    "rag",
}
SMOKE = {"mmlu", "hellaswag", "json_decode"}
# The smoke run's pool and request slots are the in-process engines' (tests/conftest.py SMALL): its step executables
# are TINY_SMOLLM2_VOCAB's at the same shapes as the tiny engines of tests/engine, which then load them from the
# persistent compilation cache.
RUNS = {
    "smoke": [
        "--dummy",
        "tiny",
        "--workloads",
        ",".join(sorted(SMOKE)),
        "--max-total-tokens",
        str(SMALL["max_total_tokens"]),
        "--max-running-requests",
        str(SMALL["max_running_requests"]),
    ],
    "full": [],
}


@pytest.fixture(scope="module", params=["smoke", pytest.param("full", marks=pytest.mark.slow)])
def quick_run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"bench-{request.param}") / "rows.jsonl"
    # PYTHONPATH: the script's own directory comes first on its sys.path, so without it the child could import
    # another checkout's sgjax through the editable install.
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(ROOT, ".jax_cache"))
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "scripts", "bench", "run.py"),
            "--quick",
            *RUNS[request.param],
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    workloads = SMOKE if request.param == "smoke" else WORKLOADS
    return {(r["workload"], r["config"]): r for r in rows}, out.parent, proc.stdout, workloads


def test_every_workload_ran_under_every_configuration(quick_run):
    rows, _, stdout, workloads = quick_run
    assert {w for w, _ in rows} == workloads
    for w in workloads:
        for c in ("full", "no_cache", "hf_baseline"):
            r = rows[(w, c)]
            assert r["programs"] >= 1 and r["programs_per_s"] > 0
            assert not any(o.startswith("<error") for o in r["outputs"]), (w, c, r["outputs"])
    assert "prog/s" in stdout  # the table was printed


def test_hit_rates_are_bounded_by_the_optimum_and_the_cache_hits(quick_run):
    rows, _, _, workloads = quick_run
    for (w, c), r in rows.items():
        if c == "hf_baseline":
            continue
        assert 0.0 <= r["hit_rate"] <= r["optimal_hit_rate"] + 1e-9, (w, c)
        if c == "no_cache":
            assert r["hit_rate"] == 0.0
    shared = {"mmlu", "hellaswag", "tree_of_thought", "llm_judge", "multi_turn_short", "rag"} & workloads
    for w in shared:
        assert rows[(w, "full")]["hit_rate"] > 0.3, w  # shared few-shot prefixes, forks, earlier turns


def test_constrained_decoding_gives_valid_json(quick_run):
    rows, _, _, _ = quick_run
    assert rows[("json_decode", "full")]["accuracy"] == 1.0
    assert rows[("json_decode", "hf_baseline")]["accuracy"] == 1.0


def test_greedy_sgjax_agrees_with_hf_on_the_labelled_workloads(quick_run):
    rows, _, _, _ = quick_run
    for w in ("mmlu", "hellaswag"):
        full, base = rows[(w, "full")], rows[(w, "hf_baseline")]
        assert full["agreement_with_baseline"] == 1.0, (full["outputs"], base["outputs"])
        assert full["accuracy"] == base["accuracy"]


def test_plots_are_written(quick_run):
    _, out_dir, _, _ = quick_run
    for name in ("bench_programs_throughput.png", "bench_programs_hit_rate.png"):
        path = out_dir / name
        assert path.stat().st_size > 10_000 and path.read_bytes()[:4] == b"\x89PNG"
