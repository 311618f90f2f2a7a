"""API speculative execution against a scripted model: the matching rules (`speculative.answer`), and the
interpreter's gen path with and without `num_api_spec_tokens` on a deterministic "greedy" model, so the values
must be equal and only the number of calls may change."""

import random
import re

import pytest

import sgjax as sgl
from sgjax.engine.detokenize import StopMatcher
from sgjax.lang import speculative
from sgjax.lang.backend.base import Backend
from sgjax.lang.interpreter import ProgramError
from sgjax.lang.speculative import Answer, Reply, answer, first_stop, make_reply

CONTEXT = "Alice flies planes for a living; she is 31.\n"
SCRIPT = "Name: Alice\nJob: pilot\nAge: 31\n"
OFF_SCRIPT = " no idea\nZZZ:"


class ScriptedModel(Backend):
    """A deterministic character-level model: after CONTEXT + a prefix of SCRIPT it says the next character of
    SCRIPT and ends (EOS) after it; after anything else, the character of OFF_SCRIPT at the prompt's length. One
    character is one token, and a call's continuation is generated character by character, so continuing a
    prompt that already holds part of an answer gives the rest of that answer (as greedy decoding does). A chat
    model's reply starts where the assistant message does, so it says SCRIPT from its beginning."""

    def __init__(self, chat=False, token_ends=True):
        self.is_chat_model = chat
        self.token_ends = token_ends
        self.calls = []

    def _next(self, text):
        said = text if self.is_chat_model else (text[len(CONTEXT) :] if text.startswith(CONTEXT) else None)
        if said is not None and SCRIPT.startswith(said):
            return SCRIPT[len(said)] if len(said) < len(SCRIPT) else None  # None: EOS
        return OFF_SCRIPT[len(text) % len(OFF_SCRIPT)]

    def _run(self, prompt, params, stops):
        base, out, m = ("" if self.is_chat_model else prompt), "", params.get("max_new_tokens", 128)
        while len(out) < m:
            ch = self._next(base + out)
            if ch is None:
                return out, {"finish_reason": {"type": "stop", "matched": None}}
            out += ch
            hit = first_stop(out, stops)
            if hit is not None:
                return out[: hit[0]], {"finish_reason": {"type": "stop", "matched": hit[2]}}
        return out, {"finish_reason": {"type": "length", "length": m}}

    def generate(self, prompt, params):
        self.calls.append(("generate", prompt, dict(params)))
        if "regex" in params:  # the longest beginning of the unconstrained continuation that matches
            out, _ = self._run(prompt, params, None)
            k = max(k for k in range(len(out) + 1) if re.fullmatch(params["regex"], out[:k]))
            return out[:k], {"finish_reason": {"type": "stop", "matched": None}}
        return self._run(prompt, params, params.get("stop"))

    def speculate(self, prompt, params):
        self.calls.append(("speculate", prompt, dict(params)))
        assert "stop" not in params
        text, meta = self._run(prompt, params, None)
        return text, meta, list(range(1, len(text) + 1)) if self.token_ends else None


def extraction(s, job_label="Job:"):
    s += CONTEXT
    s += "Name:" + sgl.gen("name", stop="\n", max_tokens=10)
    s += "\n" + job_label + sgl.gen("job", stop="\n", max_tokens=10)
    s += "\nAge:" + sgl.gen("age", stop="\n", max_tokens=10)


def run(program, backend, spec_tokens, **kwargs):
    state = sgl.function(program, num_api_spec_tokens=spec_tokens).run(backend=backend, **kwargs)
    state.sync()
    return state


def values(state, names=("name", "job", "age")):
    return {n: state[n] for n in names}


# -- the matching rules -------------------------------------------------------------------------------------------
def reply(text, anchor=0, ends=True, finished=False, params=None):
    return Reply(
        anchor, text, tuple(range(1, len(text) + 1)) if ends else None, finished, speculative.sampling_key(params or {})
    )


def test_a_stop_within_max_tokens_ends_the_value_and_stays_for_the_fixed_text():
    r = reply(" Alice\nJob: pilot\n")
    got = answer(r, "", {"stop": ["\n"], "max_new_tokens": 8})
    assert got == Answer(" Alice", 7, {"type": "stop", "matched": "\n"})  # the stop completes with token 7
    # The next gen starts after the fixed text "\nJob:", which the reply must hold exactly.
    assert answer(r, " Alice\nJob:", {"stop": ["\n"], "max_new_tokens": 8}).value == " pilot"


def test_a_stop_beyond_max_tokens_gives_max_tokens_of_text():
    got = answer(reply(" Alice\n"), "", {"stop": ["\n"], "max_new_tokens": 3})
    assert got == Answer(" Al", 3, {"type": "length", "length": 3})
    # ... exactly at the limit it is still a stop: the 7th token completes it
    assert answer(reply(" Alice\n"), "", {"stop": ["\n"], "max_new_tokens": 7}).finish_reason["type"] == "stop"


def test_without_a_stop_the_value_is_max_tokens_or_what_the_model_said_before_its_end():
    assert answer(reply("abcdef"), "", {"max_new_tokens": 4}).value == "abcd"
    assert answer(reply("ab", finished=True), "", {"max_new_tokens": 4}) == Answer(
        "ab", 2, {"type": "stop", "matched": None}
    )
    miss = answer(reply("ab"), "", {"max_new_tokens": 4, "stop": ["\n"]})  # cut by the call's own limit
    assert isinstance(miss, str) and "ends after 'ab'" in miss


def test_the_prompt_since_the_anchor_must_be_the_replys_beginning():
    r = reply(" Alice\nJob: pilot\n", anchor=5)
    state = "12345 Alice\nOccupation:"
    miss = answer(r, state, {"stop": ["\n"]})
    assert isinstance(miss, str) and "differ at character 7" in miss
    assert isinstance(answer(r, "1234", {"stop": ["\n"]}), str)  # the state is shorter than the anchor


def test_other_sampling_parameters_do_not_match():
    r = reply(" Alice\n", params={"temperature": 0})
    assert answer(r, "", {"temperature": 0, "stop": ["\n"], "max_new_tokens": 3}).value == " Al"
    assert "sampling parameters" in answer(r, "", {"temperature": 0.5, "stop": ["\n"]})


def test_unknown_token_ends_skip_the_max_tokens_check():
    r = reply(" Alice\n", ends=False)
    assert answer(r, "", {"stop": ["\n"], "max_new_tokens": 2}) == Answer(
        " Alice", None, {"type": "stop", "matched": "\n"}
    )
    assert isinstance(answer(r, "", {"max_new_tokens": 2}), str)  # no stop, no token count: cannot tell


def test_make_reply_clips_token_ends_and_reads_the_finish_reason():
    r = make_reply(3, "abc", {"finish_reason": {"type": "stop", "matched": 2}}, [1, 3, 13], {"temperature": 0})
    assert r.token_ends == (1, 3, 3) and r.finished and r.anchor == 3  # EOS: a token with no text
    assert not make_reply(0, "abc", {"finish_reason": {"type": "length"}}, None, {}).finished


def test_first_stop_agrees_with_the_engines_stop_matcher():
    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice("ab\n") for _ in range(rng.randint(0, 12)))
        stops = ["".join(rng.choice("ab\n") for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 3))]
        matcher = StopMatcher(stops)
        out, matched = "", None
        for ch in text:  # one character per token, as the engine feeds it
            safe, matched = matcher.feed(ch)
            out += safe
            if matched is not None:
                break
        hit = first_stop(text, stops)
        assert (hit is None) == (matched is None), (text, stops)
        if hit is not None:
            assert (text[: hit[0]], hit[2]) == (out, matched), (text, stops)


@pytest.mark.parametrize("n", [0, -3, True, "8", 2.5])
def test_num_api_spec_tokens_must_be_a_positive_int(n):
    with pytest.raises(ValueError, match="num_api_spec_tokens"):
        sgl.function(extraction, num_api_spec_tokens=n)


# -- the interpreter ----------------------------------------------------------------------------------------------
def test_speculation_answers_later_gens_from_the_first_reply():
    plain, spec = ScriptedModel(), ScriptedModel()
    expected = values(run(extraction, plain, None))
    assert expected == {"name": " Alice", "job": " pilot", "age": " 31"}
    state = run(extraction, spec, 16)
    assert values(state) == expected
    assert [c[0] for c in plain.calls] == ["generate"] * 3
    assert [c[0] for c in spec.calls] == ["speculate"]
    assert spec.calls[0][2] == {"max_new_tokens": 10 + 16}  # the gen's limit plus the extra tokens, no stop
    assert [state.get_meta_info(n)["speculative"] for n in ("name", "job", "age")] == ["call", "hit", "hit"]
    assert state.get_meta_info("job")["finish_reason"] == {"type": "stop", "matched": "\n"}
    assert state.text() == run(extraction, ScriptedModel(), None).text()


def test_a_failed_match_makes_the_gens_own_call():
    plain, spec = ScriptedModel(), ScriptedModel()
    expected = values(run(extraction, plain, None, job_label="Occupation:"))
    state = run(extraction, spec, 16, job_label="Occupation:")
    assert values(state) == expected
    assert "Alice" not in expected["job"] + expected["age"]  # the model went off script after the unexpected label
    job = state.get_meta_info("job")
    assert job["speculative"] == "call" and "differ at character 7" in job["miss"]  # "J" of "Job:" vs "O"
    # Each gen then made its own call (continuing past its stop again); off script, the age is not in the reply.
    assert [c[0] for c in spec.calls] == ["speculate"] * 3
    assert state.get_meta_info("age")["speculative"] == "call"


def test_a_short_max_tokens_is_kept_and_then_misses_the_fixed_text():
    def short(s):
        s += CONTEXT + "Name:" + sgl.gen("name", stop="\n", max_tokens=3) + "\nJob:" + sgl.gen("job", stop="\n")

    expected = values(run(short, ScriptedModel(), None), ("name", "job"))
    model = ScriptedModel()
    state = run(short, model, 8)
    assert values(state, ("name", "job")) == expected and expected["name"] == " Al"
    assert state.get_meta_info("name")["finish_reason"] == {"type": "length", "length": 3}
    assert len(model.calls) == 2


def test_a_gen_with_other_sampling_parameters_calls_again():
    def mixed(s):
        s += CONTEXT + "Name:" + sgl.gen("name", stop="\n") + "\nJob:" + sgl.gen("job", stop="\n", temperature=0.5)

    model = ScriptedModel()
    state = run(mixed, model, 8)
    assert state["job"] == " pilot"
    assert "sampling parameters" in state.get_meta_info("job")["miss"]
    assert len(model.calls) == 2


def test_without_token_ends_an_unfinished_reply_without_the_stop_falls_back_to_a_normal_call():
    def no_stop(s):
        s += "Something else entirely:" + sgl.gen("x", max_tokens=5)

    model = ScriptedModel(token_ends=False)
    state = run(no_stop, model, 4)
    assert state["x"] == ScriptedModel().generate("Something else entirely:", {"max_new_tokens": 5})[0]
    assert [c[0] for c in model.calls] == ["speculate", "generate"]
    meta = state.get_meta_info("x")
    assert meta["speculative"] == "fallback" and "ends after" in meta["miss"]


def test_constrained_gens_are_not_speculated_and_their_text_still_matches():
    def constrained(s):
        s += CONTEXT + "Name:" + sgl.gen("name", stop="\n") + "\nJob:" + sgl.gen("job", regex=" [a-z]+")
        s += "\nAge:" + sgl.gen("age", stop="\n")

    model = ScriptedModel()
    state = run(constrained, model, 32)
    assert values(state) == {"name": " Alice", "job": " pilot", "age": " 31"}
    assert [c[0] for c in model.calls] == ["speculate", "generate"]  # the regex gen makes its own call
    assert "speculative" not in state.get_meta_info("job")
    assert state.get_meta_info("age")["speculative"] == "hit"  # the regex value matched the reply


def test_a_speculative_program_does_not_stream():
    with pytest.raises(ValueError, match="extraction: API speculative execution .* cannot stream"):
        sgl.function(extraction, num_api_spec_tokens=16).run(backend=ScriptedModel(), stream=True)


def test_fork_branches_start_from_the_parents_reply():
    def forked(s):
        s += CONTEXT + "Name:" + sgl.gen("name", stop="\n")
        forks = s.fork(2)
        forks += ["\nJob:" + sgl.gen("x", stop="\n"), "\nJob title:" + sgl.gen("x", stop="\n")]
        forks.join()

    model = ScriptedModel()
    state = run(forked, model, 32)
    assert state["x"][0] == " pilot"
    assert state["x"][1] == ScriptedModel().generate(state.text() + "\nJob title:", {"stop": ["\n"]})[0]
    assert [f.get("speculative") for f in state.get_meta_info("x")] == ["hit", "call"]
    assert [c[0] for c in model.calls] == ["speculate", "speculate"]


def chat_extraction(s, first=""):
    s += sgl.user(CONTEXT + "Who is she?")
    s += sgl.assistant(first + "Name:" + sgl.gen("name", stop="\n") + "\nJob:" + sgl.gen("job", stop="\n"))


def test_a_chat_models_reply_must_repeat_the_messages_fixed_text():
    model = ScriptedModel(chat=True)
    state = run(chat_extraction, model, 32)
    assert values(state, ("name", "job")) == {"name": " Alice", "job": " pilot"}
    assert len(model.calls) == 1
    kind, messages, _ = model.calls[0]
    assert messages == [{"role": "user", "content": CONTEXT + "Who is she?"}]  # finished messages only
    assert state.messages()[-1] == {"role": "assistant", "content": "Name: Alice\nJob: pilot"}
    # Without speculation the gen cannot be asked for: a chat call starts a new message.
    with pytest.raises(
        ProgramError,
        match="must come first in theirs; this one follows 'Name:'; with "
        r"@sgl.function\(num_api_spec_tokens=N\)",
    ):
        run(chat_extraction, ScriptedModel(chat=True), None).text()
    # A reply that does not begin with the message's fixed text cannot answer, and there is no call to fall back on.
    with pytest.raises(ProgramError, match=r"speculation failed: the prompt since the reply began \('Hi! Name:'\)"):
        run(chat_extraction, ScriptedModel(chat=True), 32, first="Hi! ").text()


def test_a_chat_gen_must_be_inside_an_assistant_message():
    def outside(s):
        s += sgl.user("Hello " + sgl.gen("x"))

    with pytest.raises(ProgramError, match="inside assistant"):
        run(outside, ScriptedModel(chat=True), None).text()
    with pytest.raises(ProgramError, match="inside assistant"):
        run(outside, ScriptedModel(chat=True), 8).text()


# -- on the real model ----------------------------------------------------------------------------------------------
def test_on_the_engine_the_values_and_token_counts_equal_those_of_one_call_per_gen(backend):
    def card(s):
        s += "Bob is a chef. He is 40.\nName: Bob\nJob: chef\nAge: 40\n\nAlice is a pilot. She is 31.\n"
        s += "Name:" + sgl.gen("name", stop="\n", max_tokens=6) + "\nJob:" + sgl.gen("job", stop="\n", max_tokens=6)
        s += "\nAge:" + sgl.gen("age", stop="\n", max_tokens=6)

    plain = run(card, backend, None, temperature=0)
    spec = run(card, backend, 12, temperature=0)
    assert values(spec) == values(plain)
    assert [spec.get_meta_info(n)["speculative"] for n in ("name", "job", "age")] == ["call", "hit", "hit"]
    # The token ends decoded from the reply's ids count what each gen's own call generated (its stop included).
    for n in ("name", "job", "age"):
        assert spec.get_meta_info(n)["completion_tokens"] == plain.get_meta_info(n)["completion_tokens"], n
        assert spec.get_meta_info(n)["finish_reason"] == plain.get_meta_info(n)["finish_reason"], n
