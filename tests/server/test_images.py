"""Images over HTTP: `sgjax serve` on the tiny random LLaVA checkpoint (tests/llava_tiny.py, fp32, CPU) takes
SGLang's `image_data` on /generate and OpenAI's `image_url` parts on /v1/chat/completions, gives HF transformers'
greedy tokens, refuses bad images by field and keeps serving; the DSL's `sgl.image` through `RuntimeEndpoint` gets
what the server gives when called directly."""

import base64

import httpx
import numpy as np
import pytest

import sgjax as sgl
from sgjax.model.tokenizer import load_tokenizer
from tests.llava_tiny import IMAGE_TOKEN, hf_greedy, picture, png
from tests.server.conftest import assert_no_leak, serving, sse_events

# The engine test's settings (tests/engine/test_vision_engine.py), so the step shapes it compiled are reused from
# the persistent cache; chunks of 16 tokens cut an image's 16 rows across prefill steps.
FLAGS = (
    "--dtype",
    "float32",
    "--max-total-tokens",
    "2048",
    "--chunked-prefill-size",
    "16",
    "--max-running-requests",
    "4",
    "--context-length",
    "256",
)
NEW = 8
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}  # HF's reference ignores EOS too
ASK = "What is in <image>?"


@pytest.fixture(scope="module")
def server(llava):
    yield from serving("--model-path", llava[0], *FLAGS)


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tok(llava):
    return load_tokenizer(llava[0])


def generate(client, **body):
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def refused(client, route: str, body: dict, field: str, reason: str) -> str:
    r = client.post(route, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["message"].startswith(f"{field}: {reason}"), err
    return err["message"]


def test_generate_with_image_data_gives_hf_greedy_tokens(client, tok, llava):
    a, b = picture(1), picture(2)
    text = "Look: <image> What is it?"
    ids = tok.encode(text)
    assert ids.count(IMAGE_TOKEN) == 1
    want_a, want_b = hf_greedy(llava, ids, [a], NEW), hf_greedy(llava, ids, [b], NEW)
    assert want_a != want_b  # the image decides the answer, so the test can fail

    one = generate(client, text=text, image_data=png(a), sampling_params=GREEDY)  # a string: one image
    assert one["output_ids"] == want_a and one["text"] == tok.decode(want_a)
    assert one["meta_info"]["prompt_tokens"] == len(ids) - 1 + 16  # the image token became the tower's 16 rows
    assert generate(client, text=text, image_data=[png(b)], sampling_params=GREEDY)["output_ids"] == want_b
    batch = generate(client, text=[text, text], image_data=[png(b), [png(a)]], sampling_params=GREEDY)
    assert [r["output_ids"] for r in batch] == [want_b, want_a]

    # one prompt, two images (a list of strings), in prompt order
    two = "First <image> then <image>, compare."
    want = hf_greedy(llava, tok.encode(two), [a, b], NEW)
    assert generate(client, text=two, image_data=[png(a), png(b)], sampling_params=GREEDY)["output_ids"] == want
    assert generate(client, text=two, image_data=[png(b), png(a)], sampling_params=GREEDY)["output_ids"] != want

    # a stream carries its image too: the last event is the whole answer
    with client.stream(
        "POST", "/generate", json={"text": text, "image_data": png(a), "sampling_params": GREEDY, "stream": True}
    ) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and events[-2]["output_ids"] == want_a
    assert_no_leak(client)


def test_chat_image_url_part_equals_the_template_built_by_hand(client, tok, llava):
    a = picture(3)
    content = [
        {"type": "text", "text": "What is in "},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png(a)}", "detail": "low"}},
        {"type": "text", "text": "?"},
    ]
    r = client.post(
        "/v1/chat/completions",
        json={
            "model": "m",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": NEW,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert r.status_code == 200, r.text
    chat = r.json()

    text = tok.apply_chat_template([{"role": "user", "content": ASK}], add_generation_prompt=True)
    by_hand = generate(client, text=text, image_data=png(a), sampling_params=GREEDY)
    assert by_hand["output_ids"] == hf_greedy(llava, tok.encode(text), [a], NEW)
    assert chat["choices"][0]["message"]["content"] == by_hand["text"] != ""
    assert chat["usage"]["prompt_tokens"] == by_hand["meta_info"]["prompt_tokens"]
    assert chat["usage"]["completion_tokens"] == NEW

    other = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png(picture(4))}"}}
    r = client.post(
        "/v1/chat/completions",
        json={
            "model": "m",
            "max_tokens": NEW,
            "temperature": 0,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": [content[0], other, content[2]]}],
        },
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] != by_hand["text"]


def test_bad_images_are_400s_naming_the_field_and_the_server_keeps_serving(client):
    good, text = png(picture(1)), "Look: <image> What is it?"
    not_image = base64.b64encode(b"hello, not a picture").decode()
    gen = "/generate"
    refused(client, gen, {"text": text, "image_data": "%%%"}, "image_data", "not valid base64")
    refused(
        client, gen, {"text": text + " <image>", "image_data": [good, not_image]}, "image_data.1", "not an image file"
    )
    refused(
        client,
        gen,
        {"text": text, "image_data": [good, good]},
        "image_data",
        "2 image(s) but the prompt has 1 image tokens",
    )
    refused(
        client, gen, {"text": text, "image_data": "https://example.com/cat.png"}, "image_data", "URLs are not fetched"
    )
    refused(client, gen, {"text": text, "image_data": []}, "image_data", "an empty list")
    refused(client, gen, {"text": text, "image_data": [[good]]}, "image_data", "one prompt takes a string")
    refused(client, gen, {"text": [text, text], "image_data": [good]}, "image_data", "a batch of 2 prompts")
    refused(client, gen, {"text": [text, "plain"], "image_data": [good, "%%%"]}, "image_data.1", "not valid base64")
    refused(client, gen, {"text": [text, text], "image_data": [good, ["%%%"]]}, "image_data.1.0", "not valid base64")
    refused(client, gen, {"text": text, "image_data": "%%%", "stream": True}, "image_data", "not valid base64")

    def chat(url):
        return {
            "model": "m",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is in "},
                        {"type": "image_url", "image_url": {"url": url}},
                    ],
                }
            ],
        }

    part = "messages.0.content.1.image_url.url"
    refused(
        client, "/v1/chat/completions", chat("https://example.com/cat.png"), part, "http(s) image URLs are not fetched"
    )
    refused(client, "/v1/chat/completions", chat(good), part, "expected a base64 data URL")
    refused(client, "/v1/chat/completions", chat("data:image/png;base64,%%%"), part, "not valid base64")
    refused(client, "/v1/chat/completions", chat(f"data:image/png;base64,{not_image}"), part, "not an image file")

    assert generate(client, text=text, image_data=good, sampling_params=GREEDY)["meta_info"]["completion_tokens"] == NEW
    assert client.get("/health").status_code == 200
    assert_no_leak(client)


def test_dsl_image_through_runtime_endpoint_equals_the_server_called_directly(server, client, tok):
    @sgl.function
    def describe(s, photo):
        s += sgl.user("What is in " + sgl.image(photo) + "?")
        s += sgl.assistant(sgl.gen("answer", max_tokens=NEW))

    endpoint = sgl.RuntimeEndpoint(server.url)
    try:
        a, b = picture(5), picture(6)
        state = describe.run(photo=a, backend=endpoint, temperature=0)
        other = describe.run(photo=b, backend=endpoint, temperature=0)
        state.sync(), other.sync()  # a program runs in the background: finish before the client closes
    finally:
        endpoint.shutdown()

    prompt = tok.apply_chat_template([{"role": "user", "content": ASK}], add_generation_prompt=True)
    # the frontend's request: the chat template's end-of-turn as a stop string, EOS honoured
    params = {"max_new_tokens": NEW, "temperature": 0, "stop": ["<|im_end|>"]}
    direct = generate(client, text=prompt, image_data=[png(a)], sampling_params=params)
    assert state["answer"] == direct["text"] != ""
    assert state.text() == prompt + direct["text"] + "<|im_end|>\n"
    assert other["answer"] == generate(client, text=prompt, image_data=[png(b)], sampling_params=params)["text"]
    assert other["answer"] != state["answer"]  # the image reached the model through the frontend


def hf_choice_logprobs(llava, ids: list[int], start: int, picture_: np.ndarray) -> list[float]:
    """HF's logprobs of ids[start:] given what precedes them, the one IMAGE_TOKEN expanded to the tower's rows."""
    import torch

    from sgjax.model import vision as V

    _, hf, (_, _, vcfg, _) = llava
    full = [x for t in ids for x in ([t] * vcfg.num_image_tokens if t == IMAGE_TOKEN else [t])]
    px = torch.from_numpy(V.preprocess(picture_, vcfg)[None])
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([full]), pixel_values=px).logits[0].double()
    lp = torch.log_softmax(logits, -1)
    n, t = len(ids) - start, len(full)
    return [float(lp[t - n - 1 + j, full[t - n + j]]) for j in range(n)]


def test_dsl_select_after_an_image_scores_with_the_image(server, tok, llava):
    choices = ["red", "a blue sky", "cat", "light"]

    @sgl.function
    def pick(s, photo):
        s += sgl.user("What is in " + sgl.image(photo) + "?")
        s += sgl.assistant(sgl.select("answer", choices=choices))

    prefix = tok.apply_chat_template([{"role": "user", "content": ASK}], add_generation_prompt=True)
    prefix_ids = tok.encode(prefix)
    endpoint = sgl.RuntimeEndpoint(server.url)
    try:
        decisions = []
        for seed in (5, 6, 7):
            state = pick.run(photo=picture(seed), backend=endpoint)
            expected = []
            for c in choices:
                ids = tok.encode(prefix + c)
                start = next(i for i, (a, b) in enumerate(zip(prefix_ids + [None], ids)) if a != b)
                lps = hf_choice_logprobs(llava, ids, start, picture(seed))
                expected.append(sum(lps) / len(lps))
            scores = state.get_meta_info("answer")["scores"]
            np.testing.assert_allclose(scores, expected, atol=1e-4)
            assert state["answer"] == choices[int(np.argmax(expected))]
            decisions.append(scores)
    finally:
        endpoint.shutdown()
    assert not np.allclose(decisions[0], decisions[1], atol=1e-3)  # the image reached the scoring


def test_more_images_than_the_bound_are_a_400_naming_image_data(client, tok):
    """engine/limits.py's image_data bound (--max-images-per-request, 16 by default): checked before any image is
    decoded; the server keeps serving."""
    from sgjax.engine.limits import bound

    many = [png(picture(1))] * (bound("image_data") + 1)
    r = client.post("/generate", json={"text": ASK * len(many), "image_data": many, "sampling_params": GREEDY})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("image_data"), r.text
    assert "max_images_per_request" in r.json()["error"]["message"]
    assert generate(client, text=ASK, image_data=png(picture(1)), sampling_params=GREEDY)["output_ids"]
