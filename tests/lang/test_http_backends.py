"""The HTTP backends end to end on one real `sgjax serve` (SmolLM2, CPU) in a child process (the session's `server`,
tests/conftest.py, shared with tests/server): `RuntimeEndpoint` over the native API against the in-process Engine,
and `OpenAI` (the official client) against the server's OpenAI-compatible API as a black box, with and without API
speculative execution."""

import importlib.util
import json
import os
import re

import pytest

import sgjax as sgl
from sgjax.lang.backend.runtime_endpoint import ServerError
from sgjax.lang.interpreter import ProgramError
from sgjax.server.process import free_port
from tests.lang import test_upstream_programs as up
from tests.lang.conftest import assert_streams_as_a_whole_run

PAGE = 16
EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "api_speculative.py")


@pytest.fixture(scope="module")
def endpoint(server):
    rt = sgl.RuntimeEndpoint(server.url)
    yield rt
    rt.shutdown()


def openai_backend(server, endpoint, chat: bool, **kwargs):
    return sgl.OpenAI(
        endpoint.model_info["served_model_name"], base_url=server.url + "/v1", is_chat_model=chat, **kwargs
    )


@pytest.fixture(scope="module")
def completions(server, endpoint):
    return openai_backend(server, endpoint, chat=False)


@pytest.fixture(scope="module")
def chat(server, endpoint):
    return openai_backend(server, endpoint, chat=True)


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("api_speculative_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- RuntimeEndpoint ----------------------------------------------------------------------------------------------
@sgl.function
def animal_quiz(s):
    s += sgl.system("You answer briefly.")
    s += sgl.user("Name a large animal.")
    s += sgl.assistant(sgl.gen("animal", max_tokens=8, stop="."))
    s += sgl.user("Is it a mammal?")
    s += sgl.assistant(sgl.select("mammal", choices=["yes", "no"]))
    forks = s.fork(2)
    for f, q in zip(forks, ["Where does it live?", "What does it eat?"]):
        f += sgl.user(q) + sgl.assistant(sgl.gen("fact", max_tokens=10))
    forks.join()
    s += sgl.user("How much does it weigh in kg?")
    s += sgl.assistant(sgl.gen("kg", regex="[0-9]{1,5}", max_tokens=6))


def test_runtime_endpoint_runs_a_program_as_the_in_process_engine_does(endpoint, backend):
    assert endpoint.chat_template == backend.chat_template  # the role markers of the server's model
    over_http = animal_quiz.run(backend=endpoint, temperature=0)
    in_process = animal_quiz.run(backend=backend, temperature=0)
    names = ("animal", "mammal", "fact", "kg")
    assert {n: over_http[n] for n in names} == {n: in_process[n] for n in names}
    assert over_http.text() == in_process.text()
    assert len(set(over_http["fact"])) == 2 and over_http["kg"].isdigit()
    # select scored the same tokens the same way
    got, want = over_http.get_meta_info("mammal"), in_process.get_meta_info("mammal")
    assert got["choice_token_ids"] == want["choice_token_ids"]
    assert got["scores"] == pytest.approx(want["scores"], abs=2e-3)


def test_runtime_endpoint_streams_server_sent_events(endpoint):
    state = assert_streams_as_a_whole_run(endpoint)
    assert state.get_meta_info("line")["completion_tokens"] == 10


def test_the_server_cache_serves_a_few_shot_program_with_forks(endpoint):
    @sgl.function
    def few_shot(s, question):
        s += (
            "Answer with one word.\nQ: What color is the sky?\nA: Blue\nQ: What do cows drink?\nA: Water\n"
            "Q: What is the capital of France?\nA: Paris\nQ: How many legs does a spider have?\nA: Eight\n"
        )
        s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=2, stop="\n")
        forks = s.fork(2)
        forks += ["\nIs that right?" + sgl.gen("check", max_tokens=1), "\nWhy?" + sgl.gen("check", max_tokens=1)]
        forks.join()

    assert endpoint.flush_cache()
    before = endpoint.get_server_info()
    states = few_shot.run_batch(
        [{"question": q} for q in ("What do bees make?", "Which animal barks?")],
        backend=endpoint,
        temperature=0,
        num_threads=2,
    )
    after = endpoint.get_server_info()
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    cached = after["cached_tokens"] - before["cached_tokens"]
    print(
        f"\nfew-shot + fork program over HTTP: {cached} of {prompt} prompt tokens cached "
        f"(hit rate {cached / prompt:.2f}); server hit rate {before['cache_hit_rate']:.3f} -> "
        f"{after['cache_hit_rate']:.3f}"
    )
    assert cached / prompt > 0.5
    for state in states:  # each branch found its program's prefix (the frontend hint) in whole pages
        hint = state.stream_executor.hint_meta["prompt_tokens"]
        assert min(m["cached_tokens"] for m in state.get_meta_info("check")) >= hint // PAGE * PAGE - PAGE > 0


def test_runtime_endpoint_errors_name_the_problem(server, endpoint):
    with pytest.raises(ServerError, match=r"cannot reach the server at http://127.0.0.1:\d+/get_model_info"):
        sgl.RuntimeEndpoint(f"http://127.0.0.1:{free_port()}")
    with pytest.raises(ValueError, match="needs the model's tokenizer.*not on this machine; pass tokenizer_path="):
        sgl.RuntimeEndpoint(server.url, tokenizer_path="/nonexistent/model.gguf")
    state = sgl.function(lambda s: s.__iadd__("Digits: " + sgl.gen("d", regex="[0-9", max_tokens=4))).run(
        backend=endpoint
    )
    with pytest.raises(ProgramError, match=r"ServerError: .*/generate answered 400: sampling_params.regex"):
        state["d"]


@pytest.mark.parametrize(
    "check",
    [
        up.check_parallel_decoding,
        up.check_decode_json_regex,
        up.check_gen_logprobs,
        up.check_select_meta,
        up.check_stream_logprobs,
        up.check_cot_decoding,
    ],
    ids=[
        "forks_item_assignment",
        "json_regex_constants",
        "gen_logprobs",
        "select_meta",
        "async_stream_logprobs",
        "cot_decoding",
    ],
)
def test_sglangs_programs_run_through_the_runtime_endpoint(endpoint, check):
    check(endpoint)  # the ported upstream programs (test_upstream_programs.py) over sgjax serve's native API


# -- OpenAI on completions: API speculative execution ---------------------------------------------------------------
def test_speculation_extracts_the_same_fields_with_fewer_calls_and_input_tokens(completions, example):
    texts = example.passages(3, max_words=40)
    plain, plain_usage, _ = example.measure(completions, texts, None, max_tokens=12)
    spec, spec_usage, _ = example.measure(completions, texts, 24, max_tokens=12)
    print(
        f"\nthree-field extraction, {len(texts)} SQuAD passages: without speculation {plain_usage}, "
        f"with {spec_usage}: {plain_usage['calls'] / spec_usage['calls']:.2f}x fewer calls, "
        f"{plain_usage['prompt_tokens'] / spec_usage['prompt_tokens']:.2f}x fewer input tokens"
    )
    fields = example.FIELDS
    assert [[s[f] for f in fields] for s in spec] == [[s[f] for f in fields] for s in plain]
    assert plain_usage["calls"] == 3 * len(texts)
    assert spec_usage["calls"] < plain_usage["calls"]
    assert spec_usage["prompt_tokens"] < plain_usage["prompt_tokens"]
    kinds = [s.get_meta_info(f)["speculative"] for s in spec for f in fields]
    assert kinds.count("call") == spec_usage["calls"] and "hit" in kinds


def test_sglangs_completion_speculative_program_reads_token_usage(completions):
    def character(s):  # SGLang's test_completion_speculative, through its `backend.token_usage`
        s += "Construct a character within the following format:\n"
        s += "Name: Steve Jobs.\nBirthday: February 24, 1955.\nJob: Apple CEO.\n"
        s += "\nPlease generate new Name, Birthday and Job.\n"
        s += "Name:" + sgl.gen("name", stop="\n") + "\nBirthday:" + sgl.gen("birthday", stop="\n")
        s += "\nJob:" + sgl.gen("job", stop="\n") + "\n"

    token_usage = completions.token_usage
    token_usage.reset()
    sgl.function(character, num_api_spec_tokens=24).run(backend=completions, temperature=0, max_new_tokens=8).sync()
    usage_with_spec = token_usage.prompt_tokens
    token_usage.reset()
    sgl.function(character).run(backend=completions, temperature=0, max_new_tokens=8).sync()
    assert 0 < usage_with_spec < token_usage.prompt_tokens


def test_a_failed_match_calls_again_and_keeps_the_values(completions):
    def card(s):
        s += "Alice is a pilot. She is 31 years old.\nName:" + sgl.gen("name", stop="\n", max_tokens=6)
        s += "\nQ7X9 zebra code:" + sgl.gen("code", stop="\n", max_tokens=6)  # text the model will not write

    plain = sgl.function(card).run(backend=completions, temperature=0)
    plain.sync()  # run returns while the program's calls still run
    completions.usage.reset()
    spec = sgl.function(card, num_api_spec_tokens=8).run(backend=completions, temperature=0)
    assert (spec["name"], spec["code"]) == (plain["name"], plain["code"])
    meta = spec.get_meta_info("code")
    assert meta["speculative"] == "call" and "is not the reply's beginning" in meta["miss"]
    assert completions.usage.calls == 2


# -- OpenAI on completions: select, streaming, errors ---------------------------------------------------------------
@pytest.mark.parametrize(
    "method", ["token_length_normalized", "greedy_token_selection", "unconditional_likelihood_normalized"]
)
def test_completion_select_scores_the_choices_as_the_runtime_does(completions, endpoint, method):
    method = getattr(sgl, method)

    @sgl.function
    def capital(s):
        s += "Q: What is the capital of France?\nA:" + sgl.select(
            "city", choices=[" Paris", " London", " Rome"], choices_method=method
        )

    api = capital.run(backend=completions)
    native = capital.run(backend=endpoint)
    assert api["city"] == native["city"]
    got, want = api.get_meta_info("city"), native.get_meta_info("city")
    for a, b in zip(got["token_logprobs"], want["token_logprobs"], strict=True):
        assert a == pytest.approx(b, abs=2e-3)
    if "scores" in want:
        assert got["scores"] == pytest.approx(want["scores"], abs=2e-3)


def test_completion_streaming_and_usage(completions):
    completions.usage.reset()
    state = assert_streams_as_a_whole_run(completions)
    state.sync()
    whole = completions.usage.snapshot()  # the run without streaming
    assert whole["calls"] == 2 and whole["completion_tokens"] == 2 * 10
    assert state.get_meta_info("line")["finish_reason"] == {"type": "length"}
    # the stream's usage chunk counts like a whole answer's usage
    assert whole["prompt_tokens"] == 2 * state.get_meta_info("line")["prompt_tokens"]


def test_constraints_and_logprobs_reach_the_api(completions, chat):
    @sgl.function
    def number(s):
        s += "Three digits:" + sgl.gen(
            "n", regex=" [0-9]{3}", return_logprob=True, top_logprobs_num=2, return_text_in_logprobs=True
        )  # SGLang's flag: the API's entries have texts

    state = number.run(backend=completions, temperature=0)
    assert re.fullmatch(" [0-9]{3}", state["n"])
    meta = state.get_meta_info("n")
    assert "".join(tok for _, _, tok in meta["output_token_logprobs"]) == state["n"]
    assert all(lp <= 0 for lp, _, _ in meta["output_token_logprobs"] if lp is not None)

    schema = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}

    @sgl.function
    def person(s):
        s += sgl.user("How old is Alice? Answer in JSON.")
        s += sgl.assistant(sgl.gen("json", json_schema=schema, max_tokens=16))

    assert isinstance(json.loads(person.run(backend=chat, temperature=0)["json"])["age"], int)


def test_an_unreachable_api_is_named(endpoint):
    backend = sgl.OpenAI("m", base_url=f"http://127.0.0.1:{free_port()}/v1", is_chat_model=False, max_retries=0)
    state = sgl.function(lambda s: s.__iadd__("Hi" + sgl.gen("x", max_tokens=2))).run(backend=backend)
    with pytest.raises(ProgramError, match=r"ConnectionError: cannot reach the OpenAI API at http://127.0.0.1"):
        state["x"]


# -- OpenAI on chat completions -----------------------------------------------------------------------------------
def test_chat_messages_get_the_answer_the_templated_text_gets(chat, endpoint):
    @sgl.function
    def turns(s):
        s += sgl.user("Name a large animal.")
        s += sgl.assistant(sgl.gen("animal", max_tokens=8, stop="."))
        s += sgl.user("Where does it live?")
        s += sgl.assistant(sgl.gen("home", max_tokens=8))

    api = turns.run(backend=chat, temperature=0)
    native = turns.run(backend=endpoint, temperature=0)  # the server's template, the default system prompt included
    assert (api["animal"], api["home"]) == (native["animal"], native["home"])
    assert [m["content"] for m in api.messages()] == [
        "Name a large animal.",
        api["animal"],
        "Where does it live?",
        api["home"],
    ]


def test_chat_select_asks_and_matches_the_reply(chat):
    @sgl.function
    def mammal(s):
        s += sgl.user("Is a whale a mammal? Answer yes or no.")
        s += sgl.assistant(sgl.select("answer", choices=["yes", "no"]))

    state = mammal.run(backend=chat)
    meta = state.get_meta_info("answer")
    assert meta["matched_by"] == "reply"
    assert meta["reply"].strip().lower().startswith(state["answer"])
    assert state.messages()[-1] == {"role": "assistant", "content": state["answer"]}


def test_chat_speculation_reads_a_whole_card_from_one_reply(chat, endpoint):
    def card(s, person):
        s += sgl.user("Bob is a chef. He is 40. Fill in his card.")
        s += sgl.assistant("Name: Bob\nJob: chef\nAge: 40")
        s += sgl.user(person + " Fill in the card.")
        s += sgl.assistant(
            "Name:"
            + sgl.gen("name", stop="\n", max_tokens=6)
            + "\nJob:"
            + sgl.gen("job", stop="\n", max_tokens=6)
            + "\nAge:"
            + sgl.gen("age", stop="\n", max_tokens=6)
        )

    person = "Alice is a pilot. She is 31."
    native = sgl.function(card).run(person, backend=endpoint, temperature=0)  # one request per gen, on the text
    native.sync()
    chat.usage.reset()
    api = sgl.function(card, num_api_spec_tokens=12).run(person, backend=chat, temperature=0)
    assert [api[n] for n in ("name", "job", "age")] == [native[n] for n in ("name", "job", "age")]
    assert chat.usage.calls == 1
    # Without speculation a chat API cannot continue "Name:" in the assistant message.
    with pytest.raises(ProgramError, match="must come first in theirs; this one follows 'Name:'"):
        sgl.function(card).run(person, backend=chat, temperature=0).text()


def test_images_reach_the_text_only_server_which_refuses_them_by_name(endpoint):
    """SmolLM2 has no vision tower: a clear 400 (tests/server/test_images.py runs images on a LLaVA server)."""
    import numpy as np

    @sgl.function
    def caption(s):
        s += "Photo: " + sgl.image(np.zeros((4, 4, 3), np.uint8)) + "\nCaption: " + sgl.gen("c", max_tokens=4)

    with pytest.raises(ProgramError, match=r"/generate answered 400: image_data: this server's model is text-only"):
        caption.run(backend=endpoint)["c"]
    assert caption.run(backend=endpoint, temperature=0).error() is not None
