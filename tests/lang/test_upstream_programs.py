"""SGLang's own frontend programs (its `sglang/test/test_programs.py`, `test/lang/` and frontend examples), ported
with only the import changed (`import sgjax as sgl`): our own code written from their behaviour, with small
max_tokens, run on the real SmolLM2 through the in-process engine. The asserts are on the API's behaviour and
structure (variables, fork counts, meta info keys, logprob lists aligned with tokens, regex full matches), not on
what a 135M model answers. `test_http_backends.py` runs the `check_*` programs here through `RuntimeEndpoint`
against a real `sgjax serve`."""

import asyncio
import math
import re

import pytest

import sgjax as sgl
from sgjax.lang.ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR

FORK_SIZE = 3


# -- parallel decoding: forks[i] += ... (SGLang's test_parallel_decoding, shortened) ---------------------------------
@sgl.function
def parallel_decoding(s, topic):
    s += "Act as a helpful assistant.\n"
    s += "USER: Give some tips for " + topic + ".\n"
    s += "ASSISTANT: Okay. Here are " + str(FORK_SIZE) + " concise tips, each under 8 words:\n"
    for i in range(1, 1 + FORK_SIZE):
        s += f"{i}." + sgl.gen(max_tokens=4, stop=[".", "\n"]) + ".\n"
    forks = s.fork(FORK_SIZE)
    for i in range(FORK_SIZE):
        forks[i] += f"Now, I expand tip {i + 1} into a detailed paragraph:\nTip {i + 1}:"
        forks[i] += sgl.gen("detailed_tip", 4, stop=["\n\n"])
    forks.join()
    s += "Here are these tips with detailed explanation:\n"
    for i in range(FORK_SIZE):
        s += f"Tip {i + 1}:" + forks[i]["detailed_tip"] + "\n"
    s += "\nIn summary," + sgl.gen("summary", max_tokens=4)


def check_parallel_decoding(backend):
    state = parallel_decoding.run(topic="writing a good blog post", temperature=0, backend=backend)
    tips = state["detailed_tip"]  # the join gathered the branches' values
    assert isinstance(tips, list) and len(tips) == FORK_SIZE and all(isinstance(t, str) for t in tips)
    assert isinstance(state["summary"], str)
    text = state.text()
    for i, tip in enumerate(tips):
        assert f"Tip {i + 1}:{tip}\n" in text
    return state


def test_parallel_decoding_appends_to_each_fork_by_index(backend):
    check_parallel_decoding(backend)


# -- JSON with SGLang's regex constants (test_decode_json_regex) ----------------------------------------------------
@sgl.function
def decode_json_regex(s):
    s += "Generate a JSON object to describe the basic city information of Paris.\n"
    s += "Here are the JSON object:\n"
    with s.var_scope("json_output"):
        s += "{\n"
        s += '  "name": ' + sgl.gen("name", regex=REGEX_STR, max_tokens=6) + ",\n"
        s += '  "population": ' + sgl.gen("population", regex=REGEX_INT, stop=[" ", "\n"], max_tokens=6) + ",\n"
        s += '  "area": ' + sgl.gen("area", regex=REGEX_INT, stop=[" ", "\n"], max_tokens=6) + ",\n"
        s += '  "latitude": ' + sgl.gen("latitude", regex=REGEX_FLOAT, stop=[" ", "\n"], max_tokens=6) + "\n"
        s += "}"


def check_decode_json_regex(backend):
    from sgjax.fsm.automaton import compile_regex

    state = decode_json_regex.run(temperature=0, backend=backend)
    for name, pattern, whole in (
        ("name", REGEX_STR, REGEX_STR),
        ("population", REGEX_INT, r"[-+]?[0-9]+"),
        ("area", REGEX_INT, r"[-+]?[0-9]+"),
        ("latitude", REGEX_FLOAT, r"[-+]?[0-9]*\.?[0-9]+"),
    ):
        value = state[name]
        if state.get_meta_info(name)["finish_reason"]["type"] == "length":  # cut by max_tokens: a match's prefix
            assert compile_regex(pattern).step(0, value.encode()) >= 0, (name, value)
        else:  # a number ends at a stop (trimmed), a string at its closing quote
            assert re.fullmatch(whole, value, re.ASCII), (name, value)
    assert state["json_output"] == (
        '{\n  "name": '
        + state["name"]
        + ',\n  "population": '
        + state["population"]
        + ',\n  "area": '
        + state["area"]
        + ',\n  "latitude": '
        + state["latitude"]
        + "\n}"
    )
    return state


def test_json_from_sglangs_regex_constants(backend):
    # SGLang's program asserts json.loads(json_output); SmolLM2 writes digits one token at a time and runs the
    # numbers past max_tokens, so here each field is checked against its regex instead.
    check_decode_json_regex(backend)


def test_dtype_gens_stop_at_the_first_space_or_newline(backend):
    @sgl.function
    def dtype_gen(s):  # SGLang's test_dtype_gen, shortened
        s += "Q: Which year was DNS invented?\nA: " + sgl.gen("int_res", dtype=int, max_tokens=8) + "\n"
        s += "Q: What is the value of pi?\nA: " + sgl.gen("float_res", dtype=float, max_tokens=8) + "\n"
        s += "Q: Is the sky blue?\nA: " + sgl.gen("bool_res", dtype=bool) + "\n"
        s += "Q: Name a color.\nA: " + sgl.gen_string("str_res", max_tokens=8) + "\n"

    state = dtype_gen.run(temperature=0, backend=backend)
    int(state["int_res"]), float(state["float_res"])  # SGLang's asserts
    assert re.fullmatch(r"[-+]?[0-9]+", state["int_res"]) and state["bool_res"] in ("True", "False")
    assert state.get_meta_info("int_res")["finish_reason"]["type"] == "stop"  # ended at a space / newline
    assert state["str_res"].startswith('"')


# -- logprobs: gen(return_logprob, top_logprobs_num, return_text_in_logprobs) and select -----------------------------
@sgl.function
def logprob_gen(s):
    s += "The capital of France is" + sgl.gen(
        "answer", max_tokens=5, return_logprob=True, top_logprobs_num=2, return_text_in_logprobs=True
    )


def check_gen_logprobs(backend):
    state = logprob_gen.run(temperature=0, backend=backend)
    meta = state.get_meta_info("answer")
    for key in ("input_token_logprobs", "output_token_logprobs", "input_top_logprobs", "output_top_logprobs"):
        assert key in meta
    out = meta["output_token_logprobs"]
    assert len(out) == meta["completion_tokens"] == len(meta["output_top_logprobs"]) == 5
    assert "".join(text for _, _, text in out) == state["answer"]  # each entry carries its token's text
    for (lp, token, _), top in zip(out, meta["output_top_logprobs"]):
        assert lp <= 0 and len(top) == 2 and all(isinstance(t[2], str) for t in top)
        assert top[0][1] == token and top[0][0] == pytest.approx(lp, abs=1e-4)  # greedy: the best token
    return state


def test_gen_logprobs_carry_sglangs_meta_info(backend):
    check_gen_logprobs(backend)


@sgl.function
def tool_choice(s, question):  # SGLang's choices_logprob example
    s += "To answer this question: " + question + ", "
    s += "I need to use a " + sgl.gen("tool", choices=["calculator", "search engine"])


def check_select_meta(backend):
    state = tool_choice.run("What is 5 + 5?", backend=backend)
    meta = state.get_meta_info("tool")
    assert state["tool"] in ("calculator", "search engine")
    rows = meta["input_token_logprobs"]
    assert len(rows) == 2 and len(meta["output_token_logprobs"]) == 2
    for row, ids, mean in zip(rows, meta["choice_token_ids"], meta["normalized_prompt_logprobs"]):
        assert [t for _, t, _ in row] == ids  # one [logprob, token_id, text] entry per choice token
        assert sum(lp for lp, _, _ in row) / len(row) == pytest.approx(mean)
    assert "".join(text for _, _, text in rows[1]).strip() == "search engine"
    return state


def test_select_meta_info_has_sglangs_keys(backend):
    check_select_meta(backend)
    greedy = sgl.select("tool", ["calculator", "search engine"], choices_method=sgl.greedy_token_selection)
    uncond = sgl.select("tool", ["calculator", "search engine"], choices_method=sgl.unconditional_likelihood_normalized)
    for expr, keys in (
        (greedy, ["greedy_logprob_matrix"]),
        (uncond, ["unconditional_token_logprobs", "normalized_unconditional_prompt_logprobs"]),
    ):
        state = sgl.function(lambda s, e=expr: s.__iadd__("I need to use a " + e)).run(backend=backend)
        meta = state.get_meta_info("tool")
        assert all(k in meta for k in keys + ["normalized_prompt_logprobs", "input_token_logprobs"])


# -- streaming with meta data (test_stream_logprobs) ----------------------------------------------------------------
@sgl.function
def stream_qa(s, question):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", return_logprob=True))


def check_stream_logprobs(backend):
    async def collect():
        state = stream_qa.run(
            question="Write a line about Hawaii.", stream=True, temperature=0, max_new_tokens=8, backend=backend
        )
        return [c async for c in state.text_async_iter("answer", return_meta_data=True)], state

    chunks, state = asyncio.run(collect())
    assert len(chunks) > 1
    prev = 0
    for text, meta in chunks:  # SGLang's asserts: each chunk carries its own new output logprobs
        assert text and "output_token_logprobs" in meta
        assert meta["completion_tokens"] == meta["output_token_logprobs_length"]
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] - prev
        prev = meta["completion_tokens"]
    assert "".join(t for t, _ in chunks) == state["answer"]
    return state


def test_text_async_iter_streams_pieces_with_their_logprobs(backend):
    check_stream_logprobs(backend)

    async def plain():  # the streaming example's form: pieces only
        state = stream_qa.run(question="Hi.", stream=True, max_new_tokens=4, temperature=0, backend=backend)
        return "".join([p async for p in state.text_async_iter(var_name="answer")]), state["answer"]

    streamed, whole = asyncio.run(plain())
    assert streamed == whole


# -- fork idioms of the examples: forks += shared exprs (parallel_sample), multi-stage fork ---------------------------
def test_parallel_sample_and_multi_stage_fork(backend):
    @sgl.function
    def parallel_sample(s, question, n):
        s += "Question: Compute 1 + 2 + 3\nReasoning: I need to use a calculator.\nTool: calculator\nAnswer: 6\n"
        s += "Question: " + question + "\n"
        forks = s.fork(n)
        forks += "Reasoning:" + sgl.gen("reasoning", stop="\n", max_tokens=4) + "\n"  # one expr for every fork
        forks += "Tool:" + sgl.gen("tool", choices=["calculator", "browser"]) + "\n"
        forks.join()

    state = parallel_sample.run(question="Compute 5 + 2 + 4.", n=3, temperature=1.0, backend=backend)
    assert len(state["reasoning"]) == len(state["tool"]) == 3
    assert set(state["tool"]) <= {"calculator", "browser"}

    @sgl.function
    def industry_sweep(s, context, companies):
        s += context + "\n"
        forks = s.fork(len(companies))
        for i, (ticker, summary) in enumerate(companies.items()):
            forks[i] += f"--- Company: {ticker} ---\n{summary}\n"
            forks[i] += sgl.gen(f"analysis_{ticker}", max_tokens=4, stop="\n\n")
        for i, ticker in enumerate(companies):
            s += f"\n[{ticker}] " + forks[i][f"analysis_{ticker}"]
        s += "\nTop pick:" + sgl.gen("pick", max_tokens=4)

    state = industry_sweep.run(
        context="Chipmakers.", companies={"NVDA": "GPUs.", "AMD": "CPUs and GPUs."}, temperature=0, backend=backend
    )
    assert isinstance(state["pick"], str) and "[NVDA] " in state.text() and "[AMD] " in state.text()


# -- compiler mode: Function.compile() on a multi-function program (test_tracing's test_multi_function) ------------
@sgl.function
def expand(s, tip):
    s += "Please expand the following tip into a detailed paragraph:" + tip + "\n"
    s += sgl.gen("detailed_tip", max_tokens=4)


@sgl.function
def tip_suggestion(s, topic):
    s += "Here are 2 tips for " + topic + ".\n"
    s += "1." + sgl.gen("tip_1", stop=["\n", ":", "."], max_tokens=4) + "\n"
    s += "2." + sgl.gen("tip_2", stop=["\n", ":", "."], max_tokens=4) + "\n"
    branch1 = expand(tip=s["tip_1"])
    branch2 = expand(tip=s["tip_2"])
    s += "Tip 1: " + branch1["detailed_tip"] + "\n"
    s += "Tip 2: " + branch2["detailed_tip"] + "\n"
    s += "In summary" + sgl.gen("summary", max_tokens=4)


def test_a_compiled_multi_function_program_runs_as_the_interpreter_does(backend):
    compiled = tip_suggestion.compile(backend=backend)
    assert compiled.graph.num_streams == 3  # the program and its two calls of expand
    state = compiled.run(topic="staying healthy", temperature=0, backend=backend)
    interpreted = tip_suggestion.run(topic="staying healthy", temperature=0, backend=backend)
    assert state.text() == interpreted.text() and state["summary"] == interpreted["summary"]
    states = compiled.run_batch(
        [{"topic": "staying healthy"}, {"topic": "staying happy"}], temperature=0, backend=backend
    )
    assert [s.text() for s in states][0] == state.text() and "staying happy" in states[1].text()


# -- separate_reasoning on a model that never thinks -----------------------------------------------------------------
def test_separate_reasoning_on_a_model_without_think_tags(backend):
    @sgl.function
    def basic_qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant_begin()
        s += sgl.separate_reasoning(sgl.gen("answer", max_tokens=6), model_type="qwen3")
        s += sgl.assistant_end()

    state = basic_qa.run(question="What is 1 + 1?", temperature=0, backend=backend)
    assert state["answer_reasoning_content"] == "" and state["answer"]
    assert state.messages()[-1] == {"role": "assistant", "content": state["answer"]}


# -- the regex constants in sgjax's regex engine ---------------------------------------------------------------------
SAMPLES = [
    "0",
    "24",
    "-7",
    "+365",
    "24 ",
    "24\n\n",
    "2 4",
    "3.14",
    ".5",
    "-0.25 \n",
    "1.",
    "1e5",
    "True",
    "False",
    "true",
    '""',
    '"Paris"',
    '"New York 2"',
    '"a_b"',
    '"x"y"',
    "Paris",
    '"tab\t"',
    "",
    " 1",
    "٣",
]


@pytest.mark.parametrize(
    "pattern", [REGEX_INT, REGEX_FLOAT, REGEX_BOOL, REGEX_STR], ids=["int", "float", "bool", "str"]
)
def test_sglangs_regex_constants_compile_and_match_what_python_matches(pattern):
    from sgjax.fsm.automaton import compile_regex

    dfa = compile_regex(pattern)  # the spelling SGLang exports compiles as is
    for text in SAMPLES:  # the dialect's classes are ASCII: Python's re with re.ASCII matches the same strings
        assert dfa.accepts(text.encode()) == bool(re.fullmatch(pattern, text, re.ASCII)), (pattern, text)


# -- CoT decoding (upstream's examples/frontend_language/usage/cot_decoding.py, shortened) ----------------------------
@sgl.function
def cot_decoding(s, question, get_top_k):
    """CoT decoding (arXiv 2402.10200): the top-k first tokens from a prefill-only gen, one fork each, continued
    greedily; the disparity of each continuation's top two probabilities scores it."""
    s += "Question: " + question + "\nAnswer:"
    step_0 = s.fork(1)[0]
    forks = s.fork(get_top_k)
    step_0 += sgl.gen(
        "get_top_k", max_tokens=0, return_logprob=True, top_logprobs_num=get_top_k, return_text_in_logprobs=True
    )
    logprobs = step_0.get_meta_info("get_top_k")["output_top_logprobs"][0]
    branches = []
    for f, (logprob, token_id, text) in zip(forks, logprobs):
        f += text
        f += sgl.gen(
            "answer", temperature=0, max_tokens=8, return_logprob=True, top_logprobs_num=2, return_text_in_logprobs=True
        )
        tops = f.get_meta_info("answer")["output_top_logprobs"]
        delta = sum(math.exp(xt[0][0]) - math.exp(xt[1][0]) for xt in tops) / len(tops)
        branches.append((text, f["answer"], delta))
    return step_0.get_meta_info("get_top_k"), branches


def check_cot_decoding(backend):
    k = 3
    state = cot_decoding.run(question="What is 2 + 3?", get_top_k=k, backend=backend)
    meta, branches = state.ret_value
    (tops,) = meta["output_top_logprobs"]  # the next token's distribution, once
    assert len(tops) == k and all(len(t) == 3 and isinstance(t[2], str) for t in tops)
    assert [t[0] for t in tops] == sorted((t[0] for t in tops), reverse=True)
    assert meta["output_token_logprobs"] == []
    assert [b[0] for b in branches] == [t[2] for t in tops]  # one branch per first token, in order
    assert all(isinstance(answer, str) and delta >= 0 for _, answer, delta in branches)
    return state


def test_cot_decoding_reads_the_first_tokens_distribution_from_a_prefill_only_gen(backend):
    check_cot_decoding(backend)


def test_runtime_endpoint_takes_a_chat_template(engine):
    """Upstream's LLaVA example: `runtime.endpoint.chat_template = get_chat_template(...)`."""
    from sgjax.lang.backend.engine import Runtime
    from sgjax.lang.chat_template import get_chat_template

    runtime = Runtime.__new__(Runtime)
    super(Runtime, runtime).__init__(engine)  # the shared engine, not a second model load
    runtime.endpoint.chat_template = get_chat_template("chatml")
    assert runtime.get_chat_template() is runtime.chat_template == get_chat_template("chatml")
