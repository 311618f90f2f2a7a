"""The #42 crash, and the path it hit. CI workers died on the engine thread compiling a new step shape (or, before,
writing it to jax's persistent cache). A core dump of one showed why: the worker held 65506 memory maps, the
kernel's limit (vm.max_map_count, 65530), because every engine config a process had ever made kept its jitted
step, and each compiled program keeps its machine code in maps of its own; XLA could not map the next program
("Failed to materialize symbols") and the process died unwinding that error. Engines now share a step only while
one holds it (engine/shared.py). The first test checks that a gone engine's programs are freed, maps and all; the
second keeps the compile-while-serving path busy in a child process (a crash ends it alone): a fresh persistent
cache, client threads sending requests of random lengths, sampling settings and logprob counts (many shapes), the
main thread compiling programs of its own meanwhile, and every served shape written to the cache."""

import gc
import os
import subprocess
import sys
import textwrap
import weakref

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = textwrap.dedent(
    """
    import os, sys, tempfile, threading
    import jax
    cache = tempfile.mkdtemp(prefix="sgjax-cache-")
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    import jax.numpy as jnp
    import numpy as np
    from sgjax.engine.engine import Engine
    from sgjax.model.presets import TINY_LLAMA
    from sgjax.model.weights import dummy_weights

    seed = int(sys.argv[1])
    eng = Engine.from_weights(TINY_LLAMA, dummy_weights(TINY_LLAMA, seed=1), None, page_size=4,
                              max_total_tokens=1024, chunked_prefill_size=64, max_running_requests=16)
    errors = []

    def client(worker):
        r = np.random.default_rng(seed * 100 + worker)
        for _ in range(12):
            ids = r.integers(0, 512, int(r.integers(1, 90))).tolist()
            params = {"max_new_tokens": int(r.integers(1, 30)), "temperature": float(r.choice([0.0, 0.8])),
                      "seed": int(r.integers(100))}
            try:
                eng.generate(input_ids=ids, sampling_params=params, return_logprob=bool(r.random() < 0.4),
                             top_logprobs_num=int(r.integers(0, 6)))
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))

    threads = [threading.Thread(target=client, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for n in range(1, 60):  # the main thread compiles (and caches) programs of its own meanwhile
        jax.jit(lambda x, n=n: jnp.cumsum(x * n))(jnp.ones(n)).block_until_ready()
    for t in threads:
        t.join()
    shapes = eng.get_server_info()["compiled_shapes"]
    eng.shutdown()
    assert not errors, errors[:3]
    written = sorted({name.split("-")[0] for name in os.listdir(cache)})
    print("ok", shapes, ",".join(written))
    """
)


@pytest.mark.parametrize("seed", [0])
def test_compiles_while_serving_beside_other_compiles_never_crash(seed, tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONFAULTHANDLER": "1", "PYTHONPATH": ROOT}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(seed)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ok, shapes, written = done.stdout.split()[-3:]
    assert ok == "ok" and int(shapes) >= 10  # many shapes compiled while serving
    assert "jit__lambda" in written.split(",")  # the main thread's programs were written, and the served steps
    assert [name for name in written.split(",") if name.startswith("jit_sgjax_step")], written


def _maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="counts the process's memory maps (Linux)")
def test_an_engine_gone_frees_its_compiled_programs_and_their_maps(tiny):
    from sgjax.engine import programs
    from sgjax.engine.drafter import DRAFTS
    from sgjax.engine.embed import jitted_readout
    from tests.engine.conftest import tiny_engine

    settings = dict(max_running_requests=3, chunked_prefill_size=40)  # a step no other test's engine holds
    # what earlier tests left only in the caches goes now, not while this test counts (a new step taking the last
    # one's place in STEPS freed it mid-count: CI saw the maps shrink by 160 while this engine compiled)
    for cache in (programs.STEPS, jitted_readout, DRAFTS):
        cache.drop_recent()
    gc.collect()
    before = _maps()
    engine = tiny_engine(tiny, **settings)
    twin = tiny_engine(tiny, **settings)
    assert twin.runner.step is engine.runner.step  # engines alive at once share the step and its executables
    engine.generate(input_ids=[[5, 6, 7, 8, 9] * 9, [3, 4]], sampling_params={"max_new_tokens": 3})
    grown = _maps() - before
    step = weakref.ref(engine.runner.step)
    engine.shutdown()
    assert step() is not None  # the twin still holds it
    twin.shutdown()
    programs.STEPS.drop_recent()  # the cache's own references to the last few steps
    assert step() is None  # freed at once, though both engines are still referenced
    assert grown > 100 and _maps() - before < grown / 2, (grown, _maps() - before)


def test_near_the_map_limit_an_engine_drops_its_compiled_shapes_and_keeps_its_outputs(tiny, monkeypatch):
    """A long-running engine's shapes add up (one step may hold hundreds): past shared.MAP_BUDGET of the limit, the
    runner drops them before compiling a new one. Here every new shape finds the process past its budget."""
    from sgjax.engine import shared
    from tests.engine.conftest import tiny_engine

    prompts = [[5, 6, 7, 8, 9] * 9, [3, 4], [11, 12, 13, 14]]
    params = {"max_new_tokens": 6, "temperature": 0}
    settings = dict(max_running_requests=3, chunked_prefill_size=40)
    with tiny_engine(tiny, **settings) as eng:
        want = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
    monkeypatch.setattr(shared, "MAP_BUDGET", 0.0)
    with tiny_engine(tiny, **settings) as eng:
        first = weakref.ref(eng.runner.step)
        got = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
        info = eng.get_server_info()
    assert got == want
    assert info["step_renewals"] >= 2 and first() is None  # the old step and its programs are gone
