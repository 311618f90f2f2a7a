"""The frontend end to end on the real SmolLM2 engine (fp32, CPU): every primitive, select against scores computed
from the engine's own logprobs, fork isolation, the frontend hint, the batch pre-cache, constrained gens,
streaming, and run_batch determinism."""

import importlib.util
import json
import os
import re
import sys
import uuid

import pytest

import sgjax as sgl
from sgjax.lang.global_config import global_config
from sgjax.lang.interpreter import ProgramError
from tests.lang.conftest import assert_streams_as_a_whole_run

PAGE = 16  # the engine's page size: the radix cache matches whole pages
STORY = (
    "The lighthouse keeper climbed the stairs every evening at dusk. He cleaned the lens, lit the lamp and "
    "wrote the weather in a small blue notebook. Ships passed far out at sea, and none of them knew his name, "
    "but every one of them saw his light. In winter the storms shook the tower and the waves broke over "
    "the rocks below, yet the lamp never went out."
)


def pages(n_tokens: int) -> int:
    return n_tokens // PAGE * PAGE


def test_gen_sends_the_chat_prompt_and_honours_stop_and_max_tokens(engine, backend):
    @sgl.function
    def chat(s):
        s += sgl.user("Name three colors.")
        s += sgl.assistant(sgl.gen("colors", max_tokens=12, stop=","))
        s += sgl.user("And one more?")
        s += sgl.assistant(sgl.gen("more", max_tokens=6))

    state = chat.run(backend=backend, temperature=0)
    tok = engine.tokenizer
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert state.text() == tok.apply_chat_template(messages, add_generation_prompt=False)
    # Each gen got exactly the rendered conversation so far and returned what the engine gives for it.
    first = engine.generate(
        tok.apply_chat_template(messages[:2]), {"max_new_tokens": 12, "stop": [","], "temperature": 0}
    )
    assert state["colors"] == first["text"] and "," not in state["colors"]
    assert state.get_meta_info("colors")["completion_tokens"] <= 12
    second = engine.generate(tok.apply_chat_template(messages[:4]), {"max_new_tokens": 6, "temperature": 0})
    assert state["more"] == second["text"]
    assert state.get_meta_info("more")["cached_tokens"] > 0  # the first turn's KV is reused


def _expected_choice(method, cond, uncond):
    """The method's decision computed here from raw per-token logprobs (not with sgjax.lang.choices)."""
    mean = [sum(c) / len(c) for c in cond]
    if method is sgl.token_length_normalized:
        return mean.index(max(mean)), mean
    if method is sgl.unconditional_likelihood_normalized:
        score = [sum(c - (u or 0.0) for c, u in zip(cs, us)) / len(cs) for cs, us in zip(cond, uncond)]
        return score.index(max(score)), score
    width = max(len(c) for c in cond)
    rows = [c + [m] * (width - len(c)) for c, m in zip(cond, mean)]
    alive = list(range(len(rows)))
    for j in range(width):
        best = max(rows[i][j] for i in alive)
        alive = [i for i in alive if rows[i][j] == best]
    return alive[0], None


@pytest.mark.parametrize(
    "method", ["token_length_normalized", "greedy_token_selection", "unconditional_likelihood_normalized"]
)
def test_select_agrees_with_scores_from_the_engines_full_prompt_logprobs(engine, backend, method):
    method = getattr(sgl, method)
    choices = ["Paris", "London", "a small town in the south of Spain"]
    nonce = uuid.uuid4().hex[:8]
    question = f"({nonce}) " + STORY + " What is the capital of France?"

    @sgl.function
    def quiz(s):
        s += sgl.user(question)
        s += sgl.assistant(sgl.select("city", choices=choices, choices_method=method))

    before = engine.get_server_info()["cached_tokens"]
    state = quiz.run(backend=backend)
    state.sync()
    cached = engine.get_server_info()["cached_tokens"] - before
    tok = engine.tokenizer
    prefix = tok.apply_chat_template([{"role": "user", "content": question}])
    assert state.text().startswith(prefix + state["city"])
    prefix_ids = tok.encode(prefix)
    cond, uncond = [], []
    for c in choices:
        ids = tok.encode(prefix + c)
        k = next(i for i, (a, b) in enumerate(zip(ids, prefix_ids + [-1])) if a != b)
        full = engine.generate(
            input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0
        )  # the whole prompt computed, no cache
        cond.append([lp for lp, _, _ in full["meta_info"]["input_token_logprobs"][k:]])
        alone = engine.generate(
            input_ids=ids[k:], sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0
        )
        uncond.append([lp for lp, _, _ in alone["meta_info"]["input_token_logprobs"]])
    index, scores = _expected_choice(method, cond, uncond)
    assert state["city"] == choices[index]
    meta = state.get_meta_info("city")
    for got, want in zip(meta["token_logprobs"], cond):
        assert got == pytest.approx(want, abs=2e-3)
    if scores is not None:
        assert meta["scores"] == pytest.approx(scores, abs=2e-3)
    # The choices were scored over the cached prefix: each scoring request reused its whole pages.
    assert cached >= len(choices) * pages(len(prefix_ids) - 1)


def test_fork_branches_see_the_parent_and_not_each_other(engine, backend):
    @sgl.function
    def animals(s):
        s += sgl.user("I will ask about two animals.")
        s += sgl.assistant("Sure, go ahead.")
        forks = s.fork(2)
        for f, animal in zip(forks, ["cats", "fish"]):
            f += sgl.user("One sentence about " + animal + ".")
            f += sgl.assistant(sgl.gen("fact", max_tokens=10))
        forks.join()

    state = animals.run(backend=backend, temperature=0)
    tok = engine.tokenizer
    base = [
        {"role": "user", "content": "I will ask about two animals."},
        {"role": "assistant", "content": "Sure, go ahead."},
    ]
    for fact, animal in zip(state["fact"], ["cats", "fish"]):
        prompt = tok.apply_chat_template(base + [{"role": "user", "content": f"One sentence about {animal}."}])
        assert fact == engine.generate(prompt, {"max_new_tokens": 10, "temperature": 0})["text"]
    assert state["fact"][0] != state["fact"][1]
    assert state.text() == tok.apply_chat_template(base, add_generation_prompt=False)


def test_role_forms_var_scope_copy_and_appending_join(engine, backend):
    @sgl.function
    def program(s):
        s += sgl.system_begin() + "Be brief." + sgl.system_end()
        with s.user():
            with s.var_scope("request"):
                s += "Name a fruit."
        s += sgl.assistant_begin() + sgl.gen("fruit", max_tokens=4) + sgl.assistant_end()
        with s.copy() as c:
            c += sgl.user("Its color?") + sgl.assistant(sgl.gen("color", max_tokens=4))
        forks = s.fork(2)
        forks += [
            sgl.user("A vegetable?") + sgl.assistant(sgl.gen("v", max_tokens=4)),
            sgl.user("A nut?") + sgl.assistant(sgl.gen("v", max_tokens=4)),
        ]
        forks.join("concate_and_append")
        return c, forks

    state = program.run(backend=backend, temperature=0)
    copy, forks = state.ret_value
    assert state["request"] == "Name a fruit."
    assert copy["fruit"] == state["fruit"]  # the copy starts from the parent ...
    assert [m["content"] for m in copy.messages()[3:]] == ["Its color?", copy["color"]]
    assert "Its color?" not in state.text()  # ... and does not write into it
    # The parent gets both branches' turns appended, in order, as the template renders them.
    render = engine.tokenizer.apply_chat_template
    base = state.messages()
    assert [m["role"] for m in base] == ["system", "user", "assistant"]
    turns = [
        render(
            base + [{"role": "user", "content": q}, {"role": "assistant", "content": f["v"]}],
            add_generation_prompt=False,
        )
        for q, f in zip(["A vegetable?", "A nut?"], forks)
    ]
    head = render(base, add_generation_prompt=False)
    assert state.text() == head + "".join(t[len(head) :] for t in turns)


def _branch_cached_tokens(backend, nonce):
    @sgl.function
    def questions(s):
        s += f"Document {nonce}. " + STORY
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"\nQuestion {i}: who climbed the stairs? Answer:" + sgl.gen("a", max_tokens=2)
        forks.join()

    state = questions.run(backend=backend, temperature=0)
    return [m["cached_tokens"] for m in state.get_meta_info("a")], state.stream_executor.hint_meta


def test_the_frontend_hint_raises_the_branches_cached_tokens(engine, backend, monkeypatch):
    with_hint, hint_meta = _branch_cached_tokens(backend, uuid.uuid4().hex)
    prefix_tokens = hint_meta["prompt_tokens"]
    assert hint_meta["completion_tokens"] == 0 and hint_meta["cached_tokens"] == 0
    # Every branch finds the whole prefix (in pages; the last page may retokenize with the branch's text).
    assert min(with_hint) >= pages(prefix_tokens) - PAGE > 0
    monkeypatch.setattr(global_config, "enable_frontend_hint", False)
    without, no_hint = _branch_cached_tokens(backend, uuid.uuid4().hex)
    assert no_hint is None
    assert min(without) == 0  # the branch admitted first computes the prefix itself
    assert sum(with_hint) > sum(without)


def test_run_batch_pre_caches_the_common_prefix(engine, backend, monkeypatch):
    def first_cached(nonce):
        @sgl.function
        def summary(s, topic):
            s += sgl.system(f"({nonce}) " + STORY)
            s += sgl.user("One word about " + topic + ":")
            s += sgl.assistant(sgl.gen("word", max_tokens=1))

        states = summary.run_batch(
            [{"topic": "the keeper"}, {"topic": "the sea"}], backend=backend, temperature=0, num_threads=2
        )
        return [s.get_meta_info("word")["cached_tokens"] for s in states]

    assert min(first_cached(uuid.uuid4().hex)) > 64  # the traced prefix was cached before either program ran
    monkeypatch.setattr(global_config, "enable_precache_with_tracing", False)
    assert min(first_cached(uuid.uuid4().hex)) == 0


def test_constrained_gens_match_their_regex_and_schema(backend):
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }

    @sgl.function
    def card(s):
        s += sgl.user("Invent a person: a phone number, then the person as JSON, then a number.")
        s += sgl.assistant(
            "Phone: "
            + sgl.gen("phone", regex=phone, max_tokens=16)
            + "\nJSON: "
            + sgl.gen("person", json_schema=schema, max_tokens=32)
            + "\nNumber: "
            + sgl.gen_int("n", max_tokens=3)
        )

    state = card.run(backend=backend, temperature=0)
    assert re.fullmatch(phone, state["phone"])
    person = json.loads(state["person"])
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    assert re.fullmatch(r"[-+]?[0-9]+", state["n"])


def test_streaming_from_the_engine(backend):
    assert_streams_as_a_whole_run(backend)


def test_run_batch_under_greedy_equals_running_one_by_one(backend):
    @sgl.function
    def qa(s, question):
        s += "Answer with one word.\nQ: What color is the sky?\nA: Blue\nQ: " + question + "\nA:"
        s += sgl.gen("answer", max_tokens=6, stop="\n")
        s += "\nIs that right? " + sgl.select("check", choices=["yes", "no"])

    args = [
        {"question": q}
        for q in ("What do bees make?", "What is frozen water?", "Which animal barks?", "What is the opposite of hot?")
    ]
    batch = qa.run_batch(args, backend=backend, temperature=0, num_threads=4)
    one_by_one = []
    for a in args:  # run returns while the program's stream still runs: wait, so that nothing overlaps
        one_by_one.append(qa.run(backend=backend, temperature=0, **a).text())
    assert [s.text() for s in batch] == one_by_one


def test_engine_errors_name_the_program_line(backend):
    lines = {}

    @sgl.function
    def broken(s):
        s += "Digits: "
        lines["bad"] = sys._getframe().f_lineno + 1
        s += sgl.gen("d", regex="[0-9", max_tokens=4)

    state = broken.run(backend=backend)
    with pytest.raises(
        ProgramError,
        match=rf"test_engine_e2e.py:{lines['bad']} in broken: gen\('d'\) failed: "
        r"SamplingParamsError: regex",
    ):
        state["d"]


def test_a_failed_engine_step_fails_the_program_by_name_and_the_engine_serves_on(engine, backend, monkeypatch):
    # On the H200 a failed step once reached select as "choice ... has no scored tokens": the aborted requests came
    # back with no logprobs, and the program went on as if they had been scored.
    dispatch = engine.runner.dispatch
    failures = []

    def fail_once(works):
        if not failures:
            failures.append(1)
            raise RuntimeError("device lost")
        return dispatch(works)

    @sgl.function
    def pick(s):
        s += "The sky on a clear day is" + sgl.select("colour", ["blue", "green"])

    monkeypatch.setattr(engine.runner, "dispatch", fail_once)
    with pytest.raises(
        ProgramError,
        match=r"select\('colour'.*EngineError: the engine aborted the request: "
        r"internal error: device lost",
    ):
        pick.run(backend=backend, temperature=0)["colour"]
    assert failures and pick.run(backend=backend, temperature=0)["colour"] in ("blue", "green")
    engine.check_invariants()


def test_an_engine_is_a_default_backend(engine, monkeypatch):
    monkeypatch.setattr(global_config, "default_backend", None)
    sgl.set_default_backend(engine)
    assert sgl.get_default_backend().engine is engine
    state = sgl.function(lambda s: s.__iadd__("Hello, " + sgl.gen("x", max_tokens=2))).run(temperature=0)
    assert state.get_meta_info("x")["completion_tokens"] == 2
    assert sgl.get_server_info()["cache"] == "radix"


def test_the_essay_judge_runs_end_to_end(backend):
    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "essay_judge.py")
    spec = importlib.util.spec_from_file_location("essay_judge_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    topic, essay = example.ESSAYS[0]
    state = example.essay_judge.run(topic, essay, backend=backend, temperature=0, max_new_tokens=8)
    assert state["off_topic"] in ("yes", "no")
    if state["off_topic"] == "no":
        assert len(state["judgments"]) == len(example.DIMENSIONS)
        assert re.fullmatch(example.SCHEMA, state["output"])
        json.loads(state["output"])


def test_images_on_the_text_only_engine_are_refused_by_name(backend):
    import numpy as np

    @sgl.function
    def caption(s):
        s += sgl.user("Describe " + sgl.image(np.zeros((4, 4, 3), np.uint8)))
        s += sgl.assistant(sgl.gen("c", max_tokens=4))

    state = caption.run(backend=backend)
    with pytest.raises(ProgramError, match=r"image_data: this engine's model is text-only"):
        state["c"]
