"""Step-shape discipline: with the coarse ladder (the accelerators' default) a batch of asynchronous programs (gen,
select with prompt logprobs, regex masks, forks, top logprobs) takes only shapes from a small set that follows the
token count, the start-up precompilation holds the common ones, and a second batch with other arguments compiles
only shapes of that set it had not met (each once). Shapes and compile counts do not depend on the weights: the tiny
random model with SmolLM2's
tokenizer (the `tiny` fixture) has the real vocabulary, hence the real mask widths."""

import itertools

import numpy as np
import pytest

import sgjax as sgl
from sgjax.engine.buckets import Buckets
from sgjax.engine.engine import Engine
from sgjax.engine.step import StepShape
from sgjax.lang.backend.engine import EngineBackend

# This file's own settings, not tests/conftest.py's SMALL: the coarse ladder fixes the page-table width at the
# context's pages, and a short context keeps the CPU's `ref` attention (which reads every entry) cheap.
LADDER = dict(max_total_tokens=4096, chunked_prefill_size=48, max_running_requests=8, context_length=512)
TOPICS = [
    "the sea",
    "a mountain",
    "winter",
    "a city at night",
    "an old library",
    "the desert",
    "a garden",
    "a train station",
    "the moon",
    "a forest",
    "a bridge",
    "rain",
]


@sgl.function
def program(s, topic, question):
    s += "Topic: " + topic + ". Say something short about it.\n"
    s += "Note: " + sgl.gen("note", max_tokens=6, stop="\n") + "\n"
    s += question + " " + sgl.select("mood", choices=["calm", "busy", "sad and very quiet"]) + "\n"
    s += "A year: " + sgl.gen("year", max_tokens=6, regex=r"1[89][0-9]{2}") + "\n"
    s += "One word: " + sgl.gen("word", max_tokens=3, return_logprob=True, top_logprobs_num=2) + "\n"
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"Idea {i}: " + sgl.gen("idea", max_tokens=4 + 3 * i)
    forks.join()


def arguments(topics, question):
    return [{"topic": t, "question": question} for t in topics]


def allowed_shapes(runner) -> tuple[set[StepShape], set[StepShape]]:
    """(every shape the coarse ladder can produce without penalties, the ones start-up compiles). Per token bucket:
    L in {R, T}, K in {0, the maximum}, mask words in {0, whole vocabulary}, the sampler's filters on or off, one
    page-table width; start-up takes K = 0 without filters, and the filters at L = R without a mask."""
    b: Buckets = runner.buckets
    words = -(-runner.cfg.vocab_size // 32)
    out, start = set(), set()
    for t in b.tokens_ladder(LADDER["chunked_prefill_size"] + LADDER["max_running_requests"]):
        r = b.reqs(t, 1)
        for logits, top, mask, filters in itertools.product({r, t}, (0, b.max_top_logprobs), (0, words), (False, True)):
            shape = runner_shape(t, r, runner.max_pages, logits, top, mask, b.branches(filters))
            out.add(shape)
            if top == 0 and (not filters or (logits == r and mask == 0)):
                start.add(shape)
    return out, start


def runner_shape(t, r, width, logits, top, mask, branches) -> StepShape:
    from sgjax.model.batch import BatchShape

    return StepShape(
        BatchShape(num_tokens=t, num_reqs=r, pages_per_req=width, num_logits=logits), 0, top, mask, branches=branches
    )


@pytest.fixture(scope="module")
def coarse_engine(tiny):
    with Engine.from_weights(*tiny, step_buckets="coarse", precompile=True, **LADDER) as eng:
        yield eng


def test_coarse_ladder_is_precompiled_and_async_batches_compile_nothing(coarse_engine):
    runner = coarse_engine.runner
    allowed, start = allowed_shapes(runner)
    assert len(start) <= 5 * len(runner.buckets.tokens_ladder(56))
    assert runner.shapes_seen == start  # start-up compiled the common shapes
    assert all(s.branches.draws for s in allowed)  # no device predicate in an accelerator's step
    pool = np.asarray(runner.pool)
    assert pool[:, 0].any() and not pool[:, 1:].any()  # ... and ran them (Runner.warm), writing the null page only
    backend = EngineBackend(coarse_engine)

    states = program.run_batch(arguments(TOPICS[:6], "Which mood fits?"), backend=backend, num_threads=6, temperature=0)
    assert runner.shapes_seen <= allowed  # the first batch's top logprobs compiled their K > 0 shapes
    traces = coarse_engine.get_server_info()["traces"]
    assert all(s["mood"] in ("calm", "busy", "sad and very quiet") for s in states)
    assert all(s["year"].startswith(("18", "19")) for s in states)
    assert all(s.get_meta_info("word")["output_top_logprobs"][0] for s in states)
    seen = set(runner.shapes_seen)
    coarse_engine.flush_cache()
    second = arguments(TOPICS[6:], "What mood does this place have, in one word?")
    program.run_batch(second, backend=backend, num_threads=6, temperature=0)
    new = sorted(runner.shapes_seen - allowed, key=str)
    assert runner.shapes_seen <= allowed, f"steps took shapes outside the ladder: {new}"
    # a compile only ever for a shape not seen before (timing decides which K > 0 / filter variants a batch meets)
    assert coarse_engine.get_server_info()["traces"] - traces == len(runner.shapes_seen - seen)


def test_coarse_and_fine_ladders_give_the_same_greedy_programs(coarse_engine, tiny):
    args = arguments(TOPICS[:2], "Which mood fits?")
    coarse = program.run_batch(args, backend=EngineBackend(coarse_engine), num_threads=1, temperature=0)
    with Engine.from_weights(*tiny, step_buckets="fine", **LADDER) as eng:
        fine = program.run_batch(args, backend=EngineBackend(eng), num_threads=1, temperature=0)
    assert [s.text() for s in coarse] == [s.text() for s in fine]


def test_step_buckets_must_be_known(tiny):
    with pytest.raises(ValueError, match="step_buckets"):
        Engine.from_weights(*tiny, step_buckets="huge", **LADDER)


def test_words_round_trip_every_field():
    """StepShape.to_words / from_words (the multi-host broadcast's one encoding): every field, nested ones
    included, comes back; the word count follows the fields."""
    import dataclasses
    import itertools

    import numpy as np

    from sgjax.engine.sampler import Branches
    from sgjax.engine.step import SHAPE_WORDS
    from sgjax.model.batch import BatchShape

    rng = np.random.default_rng(0)
    flags = (None, False, True)
    for draws, filters in itertools.product(flags, flags):
        t, r, p, lg, w, k, m, img = (int(v) for v in rng.integers(0, 4096, 8))
        shape = StepShape(BatchShape(t, r, p, lg), w, k, m, img, Branches(draws, filters))
        words = shape.to_words()
        assert len(words) == SHAPE_WORDS == 4 + len(dataclasses.fields(StepShape)) - 2 + 2
        assert StepShape.from_words(np.asarray(words, np.int32)) == shape
    with pytest.raises(ValueError, match="left over"):
        StepShape.from_words(list(words) + [0])
