"""Completion within a token budget (sgjax/fsm/completion.py): the fewest tokens to a finished output per state,
checked against a plain breadth-first search over the grammar's own next_state; the budget mask allows exactly the
tokens after which the rest still fits; and an engine over the tiny model whose every constrained answer within a
budget that can hold the grammar's shortest one finishes whole."""

import collections
import json

import numpy as np
import pytest

from sgjax.fsm.completion import UNREACHABLE
from sgjax.fsm.grammar import compile_grammar
from sgjax.fsm.json_schema import schema_to_regex
from sgjax.fsm.token_fsm import unpack_mask

SCHEMA = {
    "type": "object",
    "properties": {"q": {"type": "string", "maxLength": 8}, "n": {"type": "array", "items": {"type": "integer"}}},
    "required": ["q", "n"],
}
GRAMMARS = [r"ab(cd|e)*f", r"(yes|no|maybe)", r"[0-9]{2,5}", "json"]


def _grammar(pattern, vocab):
    return compile_grammar(schema_to_regex(SCHEMA) if pattern == "json" else pattern, vocab)


def _brute_force(g) -> np.ndarray:
    """Fewest tokens to a finished state by forward search from every state over next_state and the mask."""
    out = np.full(g.num_states, UNREACHABLE, np.int64)
    for start in range(g.num_states):
        seen, queue = {start}, collections.deque([(start, 0)])
        while queue:
            s, d = queue.popleft()
            if g.is_finished(s):
                out[start] = d
                break
            for t in g.allowed_tokens(s):
                nxt = g.next_state(s, int(t))
                if nxt >= 0 and nxt not in seen:
                    seen.add(nxt)
                    queue.append((nxt, d + 1))
    return out


@pytest.mark.parametrize("pattern", GRAMMARS)
def test_tokens_to_finish_is_the_shortest_path(toy_vocab, pattern):
    g = _grammar(pattern, toy_vocab)
    dist, ceiling = g.finish_counts()
    np.testing.assert_array_equal(dist, _brute_force(g))
    assert dist[g.done] == 0 and dist[0] > 0


@pytest.mark.parametrize("pattern", GRAMMARS)
def test_the_budget_mask_keeps_exactly_what_can_still_finish(toy_vocab, pattern):
    g = _grammar(pattern, toy_vocab)
    dist, ceiling = g.finish_counts()
    rng = np.random.default_rng(0)
    for state in range(g.num_states):
        if dist[state] == UNREACHABLE or g.is_finished(state):
            continue
        for remaining in {int(dist[state]), int(dist[state]) + 1, int(rng.integers(1, 12))}:
            allowed = set(np.flatnonzero(unpack_mask(g.mask_within(state, remaining)[None], g.vocab_size)[0]))
            grammar = set(g.allowed_tokens(state).tolist())
            fits = {t for t in grammar if dist[g.next_state(state, t)] <= remaining - 1}
            assert allowed == (fits or grammar), (state, remaining)  # nothing fits: the grammar's own mask
            if remaining - 1 >= ceiling[state]:
                assert allowed == grammar


def test_engine_answers_finish_whole_within_their_budget(tiny):
    """The tiny random model (whose preferences follow no grammar) under a JSON schema and max_new_tokens from 8 to
    64, sampled with seeds: every answer whose budget holds the shortest whole one finishes by the grammar and
    parses; the others end by length."""
    from tests.engine.conftest import tiny_engine

    with tiny_engine(tiny) as eng:
        g = eng.requests.grammars.get_json_schema(json.dumps(SCHEMA), eng.requests.vocabulary())
        shortest = int(g.finish_counts()[0][0])
        for budget in (8, 12, 16, 24, 32, 48, 64):
            for seed in range(3):
                out = eng.generate(
                    "Answer in JSON:",
                    {"json_schema": json.dumps(SCHEMA), "max_new_tokens": budget, "temperature": 1.0, "seed": seed},
                )
                reason = out["meta_info"]["finish_reason"]["type"]
                if budget >= shortest:
                    assert reason == "stop", (budget, seed, out["text"])
                    assert set(json.loads(out["text"])) == {"q", "n"}
                else:
                    assert reason == "length" and out["meta_info"]["completion_tokens"] == budget


@pytest.mark.parametrize("choice", ["required", "named"])
def test_tiny_model_tool_calls_parse_within_their_budget(tiny, choice):
    """The server's tool-call grammar (server/tools.plan, hermes, parallel calls) on the tiny random model, max_tokens
    from 8 to 128 over seeds: every call the answer returns (server/chat_output) parses and validates against its
    schema; a budget that holds the shortest whole answer ends in calls by the grammar; a smaller one by length with
    no call made up from the cut text. tests/server/test_tools.py runs the same rule on SmolLM2 over HTTP."""
    import jsonschema

    from sgjax.server.chat_output import ChatOutput
    from sgjax.server.protocol import ChatCompletionRequest
    from sgjax.server.tool_parsers import Hermes
    from sgjax.server.tools import plan
    from tests.engine.conftest import tiny_engine

    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    tools = [
        {"type": "function", "function": {"name": name, "parameters": params}} for name in ("get_weather", "get_time")
    ]
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_time"}}
    req = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], tools=tools, tool_choice=tool_choice
    )
    regex = plan(req, Hermes()).regex
    output = ChatOutput(tools=Hermes())
    with tiny_engine(tiny) as eng:
        shortest = int(eng.requests.grammars.get_regex(regex, eng.requests.vocabulary()).finish_counts()[0][0])
        budgets = [8, 16, 24, 32, 48, 64, 96, 128]
        runs = [(b, seed) for b in budgets for seed in range(3)]
        outs = eng.generate(
            ["Call a tool:"] * len(runs),
            [{"regex": regex, "max_new_tokens": b, "temperature": 1.0, "seed": seed} for b, seed in runs],
        )
    seen_calls = seen_length = 0
    for (budget, seed), out in zip(runs, outs):
        msg, called = output.message(out["text"])
        reason = out["meta_info"]["finish_reason"]["type"]
        for call in msg.get("tool_calls") or []:
            assert choice == "required" or call["function"]["name"] == "get_time"
            jsonschema.validate(json.loads(call["function"]["arguments"]), params)
        if budget >= shortest:
            assert reason == "stop" and called, (budget, seed, out["text"])
            seen_calls += len(msg["tool_calls"])
        else:
            assert reason == "length" and out["meta_info"]["completion_tokens"] == budget
            seen_length += 1
    assert seen_calls >= len(runs) // 2 and (seen_length > 0 or shortest <= budgets[0])
