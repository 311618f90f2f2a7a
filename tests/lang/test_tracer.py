"""Compiler mode: the essay judge's graph, clear errors on data-dependent control flow, joins, and the batch
pre-cache of the traced common prefix."""

import importlib.util
import os

import pytest

import sgjax as sgl
from sgjax.lang.global_config import global_config
from sgjax.lang.tracer import TracingError
from tests.lang.fakes import FakeBackend

_EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "essay_judge.py")


def load_essay_judge():
    spec = importlib.util.spec_from_file_location("essay_judge_example", _EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tracing_the_essay_judge_gives_its_graph():
    graph = load_essay_judge().essay_judge.trace(backend=FakeBackend(), assume={"off_topic": "no"})
    assert graph.num_streams == 4
    assert graph.kinds(0) == [
        "constant",
        "argument",
        "constant",
        "argument",
        "constant",
        "select",
        "constant",
        "fork",
        "constant",
        "variable",
        "constant",
        "variable",
        "constant",
        "variable",
        "constant",
        "gen",
        "constant",
        "gen",
        "constant",
        "gen",
        "constant",
    ]
    for branch in (1, 2, 3):
        assert graph.kinds(branch) == ["get_fork_item", "constant", "gen", "constant"]
    main = graph.stream(0)
    assert [n.label for n in main if n.kind == "argument"] == ["topic", "essay"]
    assert main[0].label == "<s>You are a strict teacher. Evaluate an essay written about a given topic.</s><u>Topic: "
    fork = next(n for n in main if n.kind == "fork")
    judgments = [next(n for n in graph.stream(b) if n.kind == "gen") for b in (1, 2, 3)]
    reads = [n for n in main if n.kind == "variable"]
    inter = {(a, b) for a, b, kind in graph.edges() if kind == "inter"}
    # Branches start from the fork; the merged judgments read the three branches' gens.
    assert inter == (
        {(fork.id, graph.stream(b)[0].id) for b in (1, 2, 3)} | {(g.id, r.id) for g, r in zip(judgments, reads)}
    )
    # Every node but a stream's first follows the previous node of its stream.
    intra = {(a, b) for a, b, kind in graph.edges() if kind == "intra"}
    for s in range(4):
        nodes = graph.stream(s)
        assert {(x.id, y.id) for x, y in zip(nodes, nodes[1:])} == intra & {(x.id, y.id) for x in nodes for y in nodes}
    assert [g.label.split()[0] for g in main if g.kind == "gen"] == ["summary", "grade", "output"]
    text = str(graph)
    assert "essay_judge: 33 nodes in 4 streams (assuming off_topic='no')" in text
    assert f"%{reads[0].id} = %{reads[0].prev} + variable judgment <- %{judgments[0].id}" in text
    assert f"= %{fork.prev} + fork 3" in text and "select off_topic ['yes', 'no']" in text


def test_data_dependent_control_flow_is_a_clear_error():
    with pytest.raises(TracingError) as info:
        load_essay_judge().essay_judge.trace(backend=FakeBackend())
    message = str(info.value)
    assert "s['off_topic'] (select at " in message and "`__eq__`" in message
    assert "essay_judge.py:" in message and "assume" in message

    @sgl.function
    def uses_an_argument(s, name):
        if len(name) > 3:
            s += "long"

    with pytest.raises(TracingError, match=r"argument 'name' .* `__len__` at .*test_tracer.py:\d+"):
        uses_an_argument.trace()

    @sgl.function
    def calls_a_method(s, name):
        s += name.upper()

    with pytest.raises(TracingError, match=r"`\.upper\(\.\.\.\)`"):
        calls_a_method.trace()
    # A concrete argument is an ordinary value: the same programs trace.
    assert uses_an_argument.trace(name="Alice").kinds(0) == ["constant"]
    assert calls_a_method.trace(name="bob").stream(0)[0].label == "BOB"


def test_join_waits_for_the_branches_and_gathers_their_variables():
    @sgl.function
    def program(s, question):
        s += "Q: " + question
        forks = s.fork(2)
        forks += lambda i: f" idea {i}: " + sgl.gen("idea")
        forks.join()
        s += " best: " + s["idea"][1]

    graph = program.trace()
    assert graph.kinds(0) == ["constant", "argument", "fork", "join", "constant", "variable"]
    join, read = graph.stream(0)[3], graph.stream(0)[5]
    branch_ends = [graph.stream(b)[-1] for b in (1, 2)]
    assert join.sources == tuple(n.id for n in branch_ends) and join.label == "gather_variable"
    assert read.sources == (branch_ends[1].id,)  # s["idea"][1] is the second branch's gen


SYSTEM = "You answer questions about geography in one word, and you never explain your answer to anyone."


@sgl.function
def geography(s, city, style):
    s += sgl.system(SYSTEM + " Style: " + style)
    s += sgl.user("Which country is " + city + " in?")
    s += sgl.assistant(sgl.gen("country", max_tokens=4))


def test_run_batch_pre_caches_the_traced_common_prefix_first(monkeypatch):
    backend = FakeBackend(reply=lambda t, p: "X")
    batch = [{"city": c, "style": "terse"} for c in ("Paris", "Rome", "Lima")]
    geography.run_batch(batch, backend=backend)
    # `style` is the same in every run: it is part of the prefix; `city` differs: the prefix stops there.
    prefix = f"<s>{SYSTEM} Style: terse</s><u>Which country is "
    assert backend.calls[0] == ("cache_prefix", prefix)
    assert backend.kinds()[1:] == ["generate"] * 3
    assert all(call[1].startswith(prefix) for call in backend.calls[1:])

    monkeypatch.setattr(global_config, "enable_precache_with_tracing", False)
    backend = FakeBackend(reply=lambda t, p: "X")
    geography.run_batch(batch, backend=backend)
    assert backend.kinds() == ["generate"] * 3


def test_function_cache_sends_the_constant_prefix():
    backend = FakeBackend()
    assert geography.cache(backend=backend) == f"<s>{SYSTEM} Style: "
    assert backend.calls == [("cache_prefix", f"<s>{SYSTEM} Style: ")]


# -- SGLang's tracer API and compiler mode ---------------------------------------------------------------------------
def test_last_node_prints_what_the_program_depends_on():
    @sgl.function
    def few_shot_qa(s, prompt, question):
        s += prompt
        s += "Q: " + question + "\n"
        s += "A:" + sgl.gen("answer", stop="\n")

    graph = few_shot_qa.bind(prompt="The following are questions with answers.\n\n").trace()
    assert graph.last_node is graph.stream(0)[-1] and graph.last_node.kind == "gen"
    assert graph.last_node.print_graph_dfs() == (
        "%0 = constant 'The following are questions with answers.\\n\\nQ: '\n"
        "%1 = %0 + argument question\n"
        "%2 = %1 + constant '\\nA:'\n"
        "%3 = %2 + gen answer (stop=['\\n'])\n"
    )


@sgl.function
def expand(s, tip):
    s += "Expand:" + tip + "\n" + sgl.gen("detailed_tip")


@sgl.function
def tips(s, topic):
    s += sgl.system("Be brief.")
    s += "Tips for " + topic + ": " + sgl.gen("tip_1") + "," + sgl.gen("tip_2")
    with s.var_scope("both"):
        s += expand(tip=s["tip_1"])["detailed_tip"] + "|" + expand(tip=s["tip_2"])["detailed_tip"]
    forks = s.fork(2)
    forks += lambda i: f" idea {i}:" + sgl.gen("idea")
    forks.join()
    s += sgl.user("Pick") + sgl.assistant(sgl.select("pick", ["a", "b"]))
    s += " " + s["idea"][1]


def test_a_called_function_is_traced_into_a_stream_of_its_own():
    graph = tips.trace(backend=FakeBackend())
    assert graph.num_streams == 5  # the program, two calls of expand, two fork branches
    callee = graph.stream(1)
    assert [n.kind for n in callee] == ["constant", "variable", "constant", "gen"]
    tip_1 = next(n for n in graph.stream(0) if n.label.startswith("tip_1"))
    assert callee[1].sources == (tip_1.id,)  # the callee reads the caller's variable: an inter-stream edge
    reads = [n for n in graph.stream(0) if n.kind == "variable"]
    assert [graph.nodes[r.sources[0]].stream for r in reads] == [1, 2, 4]


def test_a_compiled_program_runs_the_graph_as_the_interpreter_runs_the_program():
    backend = FakeBackend(reply=lambda text, p: f"<{len(text)}>", char_logprob=lambda ctx, ch: -float(ch == "a"))
    compiled = tips.compile(backend=backend)
    assert compiled.graph.num_streams == 5 and compiled.arg_names == ["topic"]
    state = compiled.run(topic="sleep", backend=backend)
    want = tips.run(topic="sleep", backend=backend)
    assert state.text() == want.text() and state.messages() == want.messages()
    for name in ("tip_1", "tip_2", "both", "idea", "pick"):
        assert state[name] == want[name]
    assert state["pick"] == "b"
    states = compiled.run_batch([{"topic": "sleep"}, {"topic": "food"}], backend=backend)
    assert states[0].text() == want.text() and "Tips for food" in states[1].text()
    with pytest.raises(TypeError, match=r"give argument\(s\) \['topic'\]"):
        compiled.run(backend=backend)


def test_compile_with_a_base_backend_that_only_carries_a_template():
    from sgjax.lang.backend.base_backend import BaseBackend
    from sgjax.lang.chat_template import get_chat_template

    @sgl.function
    def multi_turn_chat(s):
        s += sgl.user("Who are you?")
        s += sgl.assistant(sgl.gen("answer_1"))

    backend = BaseBackend()
    backend.chat_template = get_chat_template("llama-2-chat")
    compiled = multi_turn_chat.compile(backend=backend)
    assert [n.label for n in compiled.graph.stream(0) if n.kind == "constant"] == [
        "[INST] Who are you? [/INST]",
        " </s><s>",
    ]
    with pytest.raises(TracingError, match="off_topic"):
        load_essay_judge().essay_judge.compile(backend=FakeBackend())
