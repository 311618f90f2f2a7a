"""`sgjax serve --speculative-algorithm NGRAM` with the official openai client: the same greedy completions and
chats as the session's plain server (tests/conftest.py), drafts accepted, and SGLang's speculative metrics."""

import httpx
import openai
import pytest

from tests.engine.test_ngram import COPY_PROMPTS
from tests.server.conftest import SMALL_FLAGS, serving


@pytest.fixture(scope="module")
def spec_server():
    yield from serving(
        *SMALL_FLAGS, "--enable-metrics", "--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "5"
    )


def answers(base_url: str) -> list:
    oai = openai.OpenAI(base_url=base_url + "/v1", api_key="-", max_retries=0)
    out = []
    for prompt in COPY_PROMPTS:
        c = oai.completions.create(model="default", prompt=prompt, max_tokens=40, temperature=0)
        out.append((c.choices[0].text, c.choices[0].finish_reason, c.usage.completion_tokens))
    chat = oai.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Say 'one two three, one two three' four times."}],
        max_tokens=48,
        temperature=0,
        stream=True,
    )
    out.append("".join(chunk.choices[0].delta.content or "" for chunk in chat if chunk.choices))
    return out


def test_openai_answers_equal_the_plain_servers_and_drafts_are_accepted(spec_server, url):
    assert answers(spec_server.url) == answers(url)
    with httpx.Client(base_url=spec_server.url, timeout=60) as c:
        info = c.get("/get_server_info").json()
        metrics = c.get("/metrics").text
    assert info["spec_accepted_tokens"] > 10 and info["spec_accept_length"] > 1.5, info
    assert "sgjax:spec_accept_length" in metrics
    accepted = [line for line in metrics.splitlines() if line.startswith("sgjax:spec_accepted_tokens_total")]
    assert accepted and float(accepted[0].split()[-1]) == info["spec_accepted_tokens"]
