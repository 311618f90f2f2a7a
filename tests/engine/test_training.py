"""Serving a training loop (engine/training.py): weights updated in place, generation paused and continued, the KV
pool released and resumed. On the tiny random model: the new weights are other random weights, so every greedy
output changes with them."""

import threading
import time

import jax
import numpy as np
import pytest

from sgjax.errors import RequestError
from tests.engine.conftest import tiny_engine

PROMPTS = [[5, 6, 7, 8, 9] * 9, [3, 4, 5], [11, 12, 13, 14] * 5]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def _ids(outs):
    return [o["output_ids"] for o in outs]


@pytest.fixture(scope="module")
def new_weights(tiny):
    from sgjax.model.weights import dummy_weights

    return dummy_weights(tiny[0], seed=7)


@pytest.fixture(scope="module")
def want(tiny, new_weights):
    """A fresh engine's greedy outputs on the old and on the new weights."""
    cfg, weights, tok = tiny
    with tiny_engine(tiny) as eng:
        old = _ids(eng.generate(input_ids=PROMPTS, sampling_params=GREEDY))
    with tiny_engine((cfg, new_weights, tok)) as eng:
        new = _ids(eng.generate(input_ids=PROMPTS, sampling_params=GREEDY))
    assert old != new
    return old, new


def test_update_weights_serves_the_new_weights_and_reuses_no_old_prefix(tiny, new_weights, want):
    old, new = want
    with tiny_engine(tiny) as eng:
        assert _ids(eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)) == old
        assert eng.get_weights_version() == "default"
        assert eng.update_weights(new_weights, version="step-1") == "step-1"
        assert eng.get_weights_version() == "step-1"
        outs = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert _ids(outs) == new
        # the same prompts were cached under the old weights: none of it is reused
        assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, 0, 0]
        again = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert _ids(again) == new and again[0]["meta_info"]["cached_tokens"] > 0  # the new weights' prefixes are
        assert eng.update_weights(tiny[1]) == "2"  # the old weights back; versions count updates by default
        assert _ids(eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)) == old


def test_weights_in_the_steps_own_layout_are_served_without_a_copy(tiny, new_weights, want):
    from sgjax.engine.loading import run_weights

    with tiny_engine(tiny) as eng:
        served = run_weights(tiny[0], new_weights, eng.plan)
        eng.update_weights(served)
        for a, b in zip(jax.tree.leaves(eng.runner.weights), jax.tree.leaves(served)):
            assert a.unsafe_buffer_pointer() == b.unsafe_buffer_pointer()
        assert _ids(eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)) == want[1]


def test_hf_names_are_read_through_the_loaders_name_table(tiny, new_weights, want):
    from sgjax.model.weights import to_hf_state_dict

    with tiny_engine(tiny) as eng:
        eng.update_weights(to_hf_state_dict(tiny[0], new_weights))
        assert _ids(eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)) == want[1]


def test_a_wrong_leaf_is_named_and_the_engine_keeps_its_weights(tiny, new_weights, want):
    bad = jax.tree.map(lambda a: a, new_weights)
    bad.layers.wq = bad.layers.wq.astype(np.float16)
    with tiny_engine(tiny) as eng:
        with pytest.raises(RequestError, match=r"\.layers\.wq is float16") as e:
            eng.update_weights(bad)
        assert e.value.field == "params"
        with pytest.raises(RequestError, match="model_path"):
            eng.update_weights_from_disk("/nonexistent/checkpoint")
        assert _ids(eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)) == want[0]


def _generate_in_thread(eng, params):
    box = {}
    thread = threading.Thread(target=lambda: box.update(out=eng.generate(input_ids=PROMPTS, sampling_params=params)))
    thread.start()
    return thread, box


def _wait_running(eng, n=1):
    for _ in range(2000):
        if len(eng.scheduler.running) >= n:
            return
        time.sleep(0.005)
    raise AssertionError("no request started")


def test_running_requests_finish_on_the_old_weights_by_default(tiny, new_weights, want):
    long = {**GREEDY, "max_new_tokens": 60}
    with tiny_engine(tiny) as eng:
        reference = _ids(eng.generate(input_ids=PROMPTS, sampling_params=long))
        eng.flush_cache()
        thread, box = _generate_in_thread(eng, long)
        _wait_running(eng)
        eng.update_weights(new_weights)
        thread.join()
        assert _ids(box["out"]) == reference  # every token from the old weights
        assert _ids(eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)) == want[1]


def test_retract_runs_the_requests_again_on_the_new_weights_and_abort_ends_them(tiny, new_weights):
    cfg, weights, tok = tiny
    long = {**GREEDY, "max_new_tokens": 60}
    with tiny_engine(tiny) as eng:
        thread, box = _generate_in_thread(eng, long)
        _wait_running(eng)
        eng.update_weights(new_weights, abort_all_requests=True)
        thread.join()
        assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in box["out"])
        thread, box = _generate_in_thread(eng, long)
        _wait_running(eng)
        eng.update_weights(weights, retract=True)
        thread.join()
        outs = box["out"]
        assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
        assert all(len(o["output_ids"]) == 60 for o in outs)
        assert eng.scheduler.stats.retractions >= 1
        eng.check_invariants()


def test_pause_in_place_keeps_requests_and_continue_finishes_them(tiny):
    long = {**GREEDY, "max_new_tokens": 40}
    with tiny_engine(tiny) as eng:
        reference = _ids(eng.generate(input_ids=PROMPTS, sampling_params=long))
        thread, box = _generate_in_thread(eng, long)
        _wait_running(eng)
        eng.pause_generation("in_place")
        produced = [len(r.output_ids) for r in eng.scheduler.running]
        time.sleep(0.3)
        assert [len(r.output_ids) for r in eng.scheduler.running] == produced  # no step ran while paused
        assert thread.is_alive() and eng.paused
        eng.continue_generation()
        thread.join()
        assert _ids(box["out"]) == reference
        with pytest.raises(RequestError, match="mode"):
            eng.pause_generation("sideways")


def test_release_and_resume_memory_keep_serving_the_same_outputs(tiny, want):
    with tiny_engine(tiny) as eng:
        eng.release_memory_occupation()
        assert eng.runner.state is None and eng.paused
        eng.resume_memory_occupation()
        assert _ids(eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)) == want[0]
        eng.check_invariants()


def test_the_engines_logprobs_equal_the_trainers_full_sequence_forward(tiny):
    """What an RL loop's importance ratios assume: the engine's logprobs of a sequence are the ones the trainer's
    own forward gives (model/sequence.py: one jit over the whole sequence, XLA's dots, the `ref` attention), here
    against the engine's native kernels, in float32."""
    from sgjax.model.sequence import sequence_logprobs

    cfg, weights, _ = tiny
    seqs = np.random.default_rng(3).integers(0, cfg.vocab_size, (3, 40))
    want = np.asarray(sequence_logprobs(weights, cfg, seqs))
    with tiny_engine(tiny, dtype="float32") as eng:
        outs = eng.generate(
            input_ids=seqs.tolist(), sampling_params={"max_new_tokens": 1}, return_logprob=True, logprob_start_len=0
        )
    got = np.array([[lp for lp, _, _ in o["meta_info"]["input_token_logprobs"][1:]] for o in outs])
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_the_rl_loop_example_trains_and_syncs_every_step():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "rl_loop.py")
    spec = importlib.util.spec_from_file_location("rl_loop", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = module.main(["--tiny", "--steps", "2", "--batch", "4", "--new-tokens", "6"])
    assert [r["version"] for r in rows] == ["step-1", "step-2"]
    assert all(r["sync_s"] > 0 and 0 <= r["reward"] <= 1 for r in rows)


def test_an_update_leaves_no_cached_copy_of_the_old_weights(monkeypatch):
    from sgjax.engine import loading

    old, loaded, other = object(), object(), object()
    monkeypatch.setattr(
        loading, "MODELS", {("m.gguf", "float32", "auto"): ("cfg", loaded), ("n", "f", "a"): ("c", other)}
    )
    monkeypatch.setattr(
        loading, "RUN_WEIGHTS", {("m.gguf", "float32", "auto", "float32", "native", "scan"): ("cfg", old)}
    )
    loading.forget(old)
    assert loading.RUN_WEIGHTS == {} and list(loading.MODELS) == [("n", "f", "a")]
