"""Request bounds (sgjax/engine/limits.py, one table) over real HTTP: each is a 400 naming the field in the API's own
name, the requests in flight beside the refused ones are unaffected (their greedy text equals the same request
alone), and the server keeps serving."""

import concurrent.futures

import pytest

from sgjax.engine.limits import LIMITS, bound

GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
PROMPT = "The capital of France is"


def _bad_bodies(ctx: int):
    """(route, body, the field the 400 must name) for every bound the text server can hit."""
    huge = 2**63
    return [
        (
            "/generate",
            {"text": PROMPT, "sampling_params": {"max_new_tokens": huge, "ignore_eos": True}},
            "sampling_params.max_new_tokens",
        ),
        ("/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": ctx}}, "sampling_params.max_new_tokens"),
        ("/v1/completions", {"model": "m", "prompt": PROMPT, "max_tokens": huge}, "max_tokens"),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": ctx},
            "max_completion_tokens",
        ),
        ("/generate", {"text": "x " * ctx, "sampling_params": {"max_new_tokens": 1}}, "text"),
        ("/generate", {"text": PROMPT, "sampling_params": {"n": bound("n") + 1}}, "sampling_params.n"),
        (
            "/generate",
            {"text": PROMPT, "sampling_params": {"stop": ["a"] * (bound("stop") + 1)}},
            "sampling_params.stop",
        ),
        (
            "/generate",
            {"text": PROMPT, "sampling_params": {"stop": ["a" * (bound("stop_chars") + 1)]}},
            "sampling_params.stop",
        ),
        (
            "/generate",
            {"text": PROMPT, "sampling_params": {"logit_bias": {str(i): 1 for i in range(bound("logit_bias") + 1)}}},
            "sampling_params.logit_bias",
        ),
        (
            "/generate",
            {"text": PROMPT, "return_logprob": True, "top_logprobs_num": bound("top_logprobs_num") + 1},
            "top_logprobs_num",
        ),
        (
            "/generate",
            {"text": PROMPT, "sampling_params": {"regex": "a" * (bound("grammar_chars") + 1)}},
            "sampling_params.regex",
        ),
        (
            "/v1/chat/completions",
            {
                "model": "m",
                "messages": [{"role": "user", "content": "Hi"}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(4000)}},
                    },
                },
            },
            "response_format.json_schema.schema",
        ),
    ]


def test_every_bound_is_a_400_naming_its_field_and_the_requests_in_flight_are_unaffected(client):
    ctx = client.get("/get_server_info").json()["context_length"]
    want = client.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY}).json()["text"]
    bad = _bad_bodies(ctx)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        good = [
            pool.submit(client.post, "/generate", json={"text": PROMPT, "sampling_params": GREEDY}) for _ in range(3)
        ]
        refused = list(pool.map(lambda job: client.post(job[0], json=job[1]), bad))
        answers = [f.result() for f in good]
    for (route, _, field), r in zip(bad, refused):
        assert r.status_code == 400, (route, field, r.text[:300])
        assert r.json()["error"]["param"] == field, (route, r.json())
    assert [a.status_code for a in answers] == [200] * 3
    assert [a.json()["text"] for a in answers] == [want] * 3
    assert client.get("/health").status_code == 200
    info = client.get("/get_server_info").json()
    assert info["running_requests"] == 0


def test_the_table_has_a_documented_row_for_every_bound():
    import pathlib

    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "server.md").read_text()
    section = doc[doc.index("## Request bounds") :]
    for field, limit in LIMITS.items():
        assert f"`{field}`" in section, field
        if limit.setting:
            assert f"--{limit.setting.replace('_', '-')}" in section, limit.setting


@pytest.mark.parametrize("flags", [("--max-grammar-chars", "64")])
def test_the_settings_move_the_bounds(flags):
    from sgjax.cli import build_parser, split_args

    args, _ = split_args(build_parser().parse_args(["serve", *flags]))
    assert args.max_grammar_chars == 64
