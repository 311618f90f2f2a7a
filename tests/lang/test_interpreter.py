"""The interpreter on a scripted backend: asynchrony, variables, errors with the program's line, roles, fork/join,
the frontend hint, select's requests, streaming and run_batch."""

import sys
import threading
import time

import pytest

import sgjax as sgl
from sgjax.lang.global_config import global_config
from sgjax.lang.interpreter import ProgramError
from tests.lang.fakes import FakeBackend


def last_line(text):
    return text.rsplit("\n", 1)[-1]


def test_append_returns_at_once_and_reading_a_variable_blocks_until_it_exists():
    gate = threading.Event()
    backend = FakeBackend(reply=lambda text, p: "done", gate=gate)

    @sgl.function
    def program(s):
        s += "Q: " + sgl.gen("answer")

    state = program.run(backend=backend)  # the program only appends: run returns while the gen waits
    assert backend.started.wait(5)
    got = {}
    reader = threading.Thread(target=lambda: got.setdefault("answer", state["answer"]))
    reader.start()
    reader.join(0.2)
    assert reader.is_alive() and not got
    gate.set()
    reader.join(5)
    assert got == {"answer": "done"} and state.text() == "Q: done"


def test_text_variables_meta_and_sampling_parameters():
    backend = FakeBackend(reply=lambda text, p: f"<{len(text)}>")

    @sgl.function
    def program(s, topic):
        s += "About " + topic + ": "
        s += sgl.gen("a", max_tokens=5, stop="\n", temperature=0.5)
        s += " then " + sgl.gen("b", regex="[0-9]+")
        s["mine"] = 7

    state = program.run("cats", temperature=0, max_new_tokens=3, stop=["END"], backend=backend)
    assert state["a"] == "<12>" and state["b"] == "<22>"
    assert state.text() == "About cats: <12> then <22>"
    assert state.get_meta_info("a") == {"prompt": "About cats: "}
    assert state["mine"] == 7 and "a" in state and "zzz" not in state
    # The gen's own parameters override the run's; the template's end marker is always a stop string.
    assert backend.calls[0][2] == {"max_new_tokens": 5, "stop": ["\n", "</a>"], "temperature": 0.5}
    assert backend.calls[1][2] == {"max_new_tokens": 3, "stop": ["END", "</a>"], "temperature": 0, "regex": "[0-9]+"}
    with pytest.raises(KeyError, match="no variable 'zzz'"):
        state["zzz"]


def test_an_error_surfaces_where_it_is_used_with_the_program_line():
    backend = FakeBackend(fail_on="BAD")
    lines = {}

    @sgl.function
    def program(s):
        s += "fine " + sgl.gen("first")
        lines["bad"] = sys._getframe().f_lineno + 1
        s += "BAD " + sgl.gen("second")
        s += sgl.gen("third")

    state = program.run(backend=backend)
    where = f"test_interpreter.py:{lines['bad']} in program"
    for use in (lambda: state["second"], lambda: state["third"], state.text):
        with pytest.raises(ProgramError, match=where) as info:
            use()
        assert "the fake model refuses this prompt" in str(info.value)
    assert state["first"] == "[5]"  # what ran before the failure stays readable
    assert backend.kinds() == ["generate", "generate"]  # nothing runs after the failure

    @sgl.function
    def reads_it(s):
        s += "BAD " + sgl.gen("x")
        return s["x"]

    with pytest.raises(ProgramError, match="test_interpreter.py"):
        reads_it.run(backend=backend)


def test_roles_insert_the_default_system_prompt_and_record_messages():
    backend = FakeBackend(reply=lambda text, p: "hi!")

    @sgl.function
    def chat(s):
        s += sgl.user("Hello")
        s += sgl.assistant(sgl.gen("reply"))
        with s.user():
            s += "More"
        s += sgl.assistant_begin() + "ok" + sgl.assistant_end()

    state = chat.run(backend=backend)
    assert state.text() == "<s>DEFAULT</s><u>Hello</u><a>hi!</a><u>More</u><a>ok</a>"
    assert state.messages() == [
        {"role": "system", "content": "DEFAULT"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "hi!"},
        {"role": "user", "content": "More"},
        {"role": "assistant", "content": "ok"},
    ]
    assert backend.calls[0][1] == "<s>DEFAULT</s><u>Hello</u><a>"

    @sgl.function
    def nested(s):
        s += sgl.user_begin() + sgl.assistant("x")

    with pytest.raises(ProgramError, match="roles do not nest"):
        nested.run(backend=backend).text()


def test_var_scope_captures_the_text_appended_inside_it():
    @sgl.function
    def program(s):
        s += "a"
        with s.var_scope("middle"):
            s += "b" + sgl.gen("g")
        s += "c"

    state = program.run(backend=FakeBackend(reply=lambda text, p: "G"))
    assert state["middle"] == "bG" and state.text() == "abGc"


def test_fork_branches_start_from_the_parent_and_do_not_see_each_other():
    backend = FakeBackend(reply=lambda text, p: "(" + last_line(text) + ")")

    @sgl.function
    def program(s):
        s += "root " + sgl.gen("r") + "\n"
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"branch {i}: " + sgl.gen("g")
        s += "parent goes on"
        return forks

    state = program.run(backend=backend)
    forks = state.ret_value
    for i, f in enumerate(forks):
        assert f["r"] == "(root )"  # the parent's variables are inherited
        assert f.text() == f"root (root )\nbranch {i}: (branch {i}: )"
    assert state.text() == "root (root )\nparent goes on"


@pytest.mark.parametrize("mode", ["gather_variable", "concate_and_append"])
def test_join_gathers_variables_or_appends_branch_text(mode):
    backend = FakeBackend(reply=lambda text, p: last_line(text).upper())

    @sgl.function
    def program(s):
        s += "start\n"
        forks = s.fork(2)
        forks += lambda i: f"b{i} " + sgl.gen("x")
        forks.join(mode)
        s += "|end"

    state = program.run(backend=backend)
    if mode == "gather_variable":
        assert state["x"] == ["B0 ", "B1 "] and state.text() == "start\n|end"
    else:
        assert state.text() == "start\nb0 B0 b1 B1 |end" and "x" not in state


def test_fork_sends_the_frontend_hint_before_the_branches_and_the_switch_turns_it_off(monkeypatch):
    @sgl.function
    def program(s):
        s += "shared prefix "
        forks = s.fork(2)
        for f in forks:
            f += sgl.gen("g")
        forks.join()
        with s.copy() as c:  # a single copy is no fork: no hint
            c += sgl.gen("solo")

    backend = FakeBackend()
    program.run(backend=backend).sync()
    assert backend.kinds() == ["cache_prefix", "generate", "generate", "generate"]
    assert backend.calls[0][1] == "shared prefix "

    monkeypatch.setattr(global_config, "enable_frontend_hint", False)
    backend = FakeBackend()
    program.run(backend=backend).sync()
    assert backend.kinds() == ["generate"] * 3


def test_a_branch_of_a_failed_stream_raises_the_parents_error():
    lines = {}

    @sgl.function
    def program(s):
        lines["bad"] = sys._getframe().f_lineno + 1
        s += "BAD" + sgl.gen("x")
        forks = s.fork(2)
        forks += sgl.gen("y")
        return forks

    state = program.run(backend=FakeBackend(fail_on="BAD"))
    with pytest.raises(ProgramError, match=f"test_interpreter.py:{lines['bad']}"):
        state.ret_value[1]["y"]


def test_select_caches_the_prefix_then_scores_only_the_choice_tokens():
    # Character tokens; 'y' is likely after "?", everything else is not.
    backend = FakeBackend(char_logprob=lambda ctx, ch: -0.1 if ch == "y" and ctx.endswith("?") else -2.0)

    @sgl.function
    def program(s):
        s += "Is it?" + sgl.select("answer", choices=["yes", "no"])

    state = program.run(backend=backend)
    assert state["answer"] == "yes" and state.text() == "Is it?yes"
    assert backend.kinds() == ["cache_prefix", "prompt_logprobs"]
    _, ids, starts = backend.calls[1]
    assert starts == [6, 6] and [len(i) for i in ids] == [9, 8]
    assert state.get_meta_info("answer")["scores"] == pytest.approx([(-0.1 - 2 - 2) / 3, -2.0])

    @sgl.function
    def calibrated(s):
        s += "Is it?" + sgl.gen("answer", choices=["yes", "no"], choices_method=sgl.unconditional_likelihood_normalized)

    backend.calls.clear()
    calibrated.run(backend=backend).sync()
    # The unconditional pass scores the same choice tokens with no prompt at all.
    assert backend.kinds() == ["cache_prefix", "prompt_logprobs", "prompt_logprobs"]
    assert backend.calls[2][1:] == ([[ord(c) for c in "yes"], [ord(c) for c in "no"]], [0, 0])


def test_streaming_text_iter_yields_the_text_as_it_comes():
    backend = FakeBackend(pieces=["Hel", "lo", " world"])

    @sgl.function
    def program(s):
        s += "Say: " + sgl.gen("x")

    state = program.run(stream=True, backend=backend)
    assert list(state.text_iter("x")) == ["Hel", "lo", " world"]
    state = program.run(stream=True, backend=backend)
    chunks = list(state.text_iter())
    assert "".join(chunks) == "Say: Hello world" and len(chunks) > 1
    # Without stream=True, text_iter gives the whole text once.
    assert list(program.run(backend=FakeBackend(reply=lambda t, p: "X")).text_iter()) == ["Say: X"]


def test_run_batch_runs_every_program_in_order_and_keeps_failures_to_their_state(capsys):
    backend = FakeBackend(reply=lambda text, p: text.split()[-1].upper(), fail_on="boom")

    @sgl.function
    def program(s, word):
        if word == "raise":
            raise RuntimeError("the program's own bug")
        s += "A long shared instruction that every program of the batch starts with, word: " + word
        s += " " + sgl.gen("up")

    words = ["one", "two", "boom", "raise", "five"]
    states = program.run_batch([{"word": w} for w in words], num_threads=3, progress_bar=True, backend=backend)
    assert "5/5" in capsys.readouterr().err  # tqdm's bar
    assert [states[i]["up"] for i in (0, 1, 4)] == ["ONE", "TWO", "FIVE"]
    with pytest.raises(ProgramError, match="refuses"):
        states[2].text()
    with pytest.raises(RuntimeError, match="own bug"):
        states[3].text()
    assert [s["up"] for s in program.run_batch([("x",), ("y",)], num_threads=1, backend=backend)] == ["X", "Y"]


def test_gen_and_select_arguments():
    g = sgl.gen("n", dtype=int, max_tokens=4)
    # SGLang's dtype semantics: its regex (a number may end in spaces / newlines) and a stop at the first of them
    assert g.params == {"max_new_tokens": 4, "regex": r"[-+]?[0-9]+[ \n]*", "stop": [" ", "\n"]}
    assert sgl.gen("f", dtype=float, stop="x").params["stop"] == ["x", " ", "\n"]
    assert sgl.gen("j", json_schema={"type": "object"}).params == {"json_schema": '{"type": "object"}'}
    assert sgl.gen_string("s").params == {"regex": r"\"[\w\d\s]*\""}
    assert sgl.gen("c", choices=["a", "b"]).choices == ("a", "b")
    for bad, match in [
        (dict(choices=[]), "non-empty"),
        (dict(choices=["a", ""]), "non-empty"),
        (dict(choices=["a"], temperature=0.5), "temperature"),
    ]:
        with pytest.raises(ValueError, match=match):
            sgl.select("x", **bad)
    with pytest.raises(ValueError, match="at most one"):
        sgl.gen("x", regex="a", json_schema={})
    with pytest.raises(TypeError, match="first argument"):
        sgl.function(lambda state: None)
    with pytest.raises(TypeError, match="not int"):
        sgl.gen("x") + 3


def test_run_without_a_backend_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(global_config, "default_backend", None)
    with pytest.raises(RuntimeError, match="set_default_backend"):
        sgl.function(lambda s: None).run()
    with pytest.raises(TypeError, match="Backend or Engine"):
        sgl.set_default_backend("http://localhost")


def test_many_programs_do_not_leave_threads_behind():
    @sgl.function
    def program(s):
        forks = s.fork(2)
        forks += sgl.gen("x")

    before = threading.active_count()
    for _ in range(5):
        program.run(backend=FakeBackend()).sync()
    deadline = time.time() + 5
    while threading.active_count() > before and time.time() < deadline:
        time.sleep(0.01)
    assert threading.active_count() <= before


class _ConcurrencyBackend(FakeBackend):
    """Counts how many generate calls run at the same time."""

    def __init__(self):
        super().__init__()
        self.active = self.peak = 0

    def generate(self, text, params):
        with self._lock:
            self.active += 1
            self.peak = max(self.peak, self.active)
        time.sleep(0.05)
        with self._lock:
            self.active -= 1
        return super().generate(text, params)


def test_without_frontend_parallelism_calls_run_one_at_a_time(monkeypatch):
    @sgl.function
    def program(s):
        s += "prefix "
        forks = s.fork(3)
        for f in forks:
            f += sgl.gen("g")
        s += "after " + sgl.gen("h")

    backend = _ConcurrencyBackend()
    program.run(backend=backend).sync()
    assert backend.peak >= 3  # the branches (and the parent's next gen) run at once

    monkeypatch.setattr(global_config, "enable_parallelism", False)
    backend = _ConcurrencyBackend()
    state = program.run(backend=backend)
    assert backend.kinds() == ["cache_prefix", "generate", "generate", "generate", "generate"]  # run waited
    assert backend.peak == 1 and state["h"]


# -- SGLang's idioms -----------------------------------------------------------------------------------------------
def test_forks_item_assignment_appends_to_that_branch():
    backend = FakeBackend(reply=lambda text, p: "<" + last_line(text) + ">")

    @sgl.function
    def program(s):
        s += "root"
        forks = s.fork(2)
        for i in range(2):
            forks[i] += f"\nbranch {i}:"  # SGLang's idiom: __getitem__, __iadd__, then __setitem__
            forks[i] += sgl.gen("x")
        forks.join()
        with pytest.raises(TypeError, match="cannot be replaced"):
            forks[0] = forks[1]

    state = program.run(backend=backend)
    assert state["x"] == ["<branch 0:>", "<branch 1:>"] and state.text() == "root"
    assert repr(state) == "ProgramState(root)"  # SGLang's form: its examples cut the text out of it


def test_separate_reasoning_splits_the_think_block_from_the_answer():
    replies = {"Q1": "<think>2 and 2</think>4", "Q2": "just thinking</think>done", "Q3": "no tags here"}
    backend = FakeBackend(reply=lambda text, p: next(v for k, v in replies.items() if text.endswith(k + "</u><a>")))

    @sgl.function
    def program(s, model_type):
        for q in ("Q1", "Q2", "Q3"):
            s += sgl.user(q)
            s += sgl.assistant(sgl.separate_reasoning(sgl.gen("a" + q[1]), model_type=model_type))

    state = program.run(model_type="deepseek-r1", backend=backend)
    assert [state[f"a{i}"] for i in "123"] == ["4", "done", ""]  # forced: no </think> means still reasoning
    assert [state[f"a{i}_reasoning_content"] for i in "123"] == ["2 and 2", "just thinking", "no tags here"]
    assert [m["content"] for m in state.messages() if m["role"] == "assistant"] == ["4", "done", ""]
    assert "<think>" not in state.text() and "</a><u>Q2</u><a>done</a>" in state.text()

    state = program.run(model_type=None, backend=backend)  # optional: only a <think> block is reasoning
    assert [state[f"a{i}"] for i in "123"] == ["4", "just thinking</think>done", "no tags here"]
    assert [state[f"a{i}_reasoning_content"] for i in "123"] == ["2 and 2", "", ""]

    state = program.run(model_type="no-such-model", backend=backend)
    with pytest.raises(ProgramError, match="unsupported model type 'no-such-model'"):
        state["a1"]
    with pytest.raises(ValueError, match="needs a name"):
        sgl.separate_reasoning(sgl.gen(), model_type="qwen3")


def test_separate_reasoning_is_the_expression_sglang_builds():
    from sgjax.lang.ir import SglExprList, SglGen, SglSeparateReasoning

    g = sgl.gen("test_var")
    expr = sgl.separate_reasoning(g, model_type="deepseek-r1")
    assert isinstance(expr, SglExprList) and len(expr.expr_list) == 2 and expr.expr_list[0] is g
    assert isinstance(g, SglGen) and isinstance(expr.expr_list[1], SglSeparateReasoning)
    assert expr.expr_list[1].name == "test_var_reasoning_content"
    assert repr(expr.expr_list[1]) == "SeparateReasoning(model_type=deepseek-r1, name=test_var_reasoning_content)"


def test_a_streamed_separate_reasoning_splits_the_variables_and_keeps_the_streamed_text():
    backend = FakeBackend(pieces=["<think>hm", "</think>", "yes"])

    @sgl.function
    def program(s):
        s += "Q:" + sgl.separate_reasoning(sgl.gen("a"), model_type="qwen3")

    state = program.run(backend=backend, stream=True)
    assert "".join(state.text_iter()) == "Q:<think>hm</think>yes"
    assert (state["a"], state["a_reasoning_content"]) == ("yes", "hm")


def test_sglangs_gen_arguments():
    g = sgl.gen("x", return_logprob=True, top_logprobs_num=3, return_text_in_logprobs=True, n=1)
    assert g.params == {"return_logprob": True, "top_logprobs_num": 3, "return_text_in_logprobs": True}
    with pytest.raises(ValueError, match="n=2 is not supported"):
        sgl.gen("x", n=2)
    assert sgl.gen("x", stop_regex=r"\d").params == {"stop_regex": r"\d"}  # the runtime stops on it


def test_text_async_iter_without_streaming_gives_the_whole_value_once():
    import asyncio

    state = sgl.function(lambda s: s.__iadd__("Q:" + sgl.gen("a"))).run(backend=FakeBackend(reply=lambda t, p: "A"))

    async def collect(**kwargs):
        return [c async for c in state.text_async_iter(**kwargs)]

    assert asyncio.run(collect()) == ["Q:A"]
    assert asyncio.run(collect(var_name="a", return_meta_data=True)) == [("A", {"prompt": "Q:"})]


def test_a_program_called_by_a_running_program_inherits_its_backend_and_sampling_defaults():
    backend = FakeBackend(reply=lambda text, p: "x")

    @sgl.function
    def inner(s, topic):
        s += "About " + topic + ":" + sgl.gen("fact")

    @sgl.function
    def outer(s):
        s += "Topic:" + sgl.gen("topic")
        s += " Fact:" + inner(topic=s["topic"])["fact"]  # SGLang's multi-function program

    state = outer.run(backend=backend, temperature=0)  # no default backend is set
    assert state.text() == "Topic:x Fact:x"
    assert [(c[1], c[2]["temperature"]) for c in backend.calls] == [("Topic:", 0), ("About x:", 0)]
