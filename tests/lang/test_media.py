"""sgl.image and sgl.video: how images are encoded, where they go in the text and the messages, and what each backend
receives (a scripted backend for the interpreter; the real OpenAI client over a mock transport for the wire format;
the real server and Engine refuse them by name, being text-only)."""

import base64
import io
import json

import httpx
import numpy as np
import pytest
from PIL import Image as PILImage

import sgjax as sgl
from sgjax.lang.interpreter import ProgramError
from sgjax.lang.media import data_url, encode_image, sample_frames
from tests.lang.fakes import FakeBackend


def pixels(value: int, size=(4, 6)) -> np.ndarray:
    return np.full((*size, 3), value, np.uint8)


def decode(data: str) -> np.ndarray:
    return np.asarray(PILImage.open(io.BytesIO(base64.b64decode(data))))


def test_encode_image_keeps_files_and_bytes_and_encodes_pixels_losslessly(tmp_path):
    path = tmp_path / "a.jpg"
    PILImage.fromarray(pixels(90)).save(path, format="JPEG")
    raw = path.read_bytes()
    assert base64.b64decode(encode_image(str(path))) == raw  # the file's own bytes, not re-encoded
    assert base64.b64decode(encode_image(raw)) == raw
    assert data_url(encode_image(raw)).startswith("data:image/jpeg;base64,")
    array = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    np.testing.assert_array_equal(decode(encode_image(array)), array)
    np.testing.assert_array_equal(decode(encode_image(PILImage.fromarray(array))), array)
    assert data_url(encode_image(array)).startswith("data:image/png;base64,")
    assert encode_image("https://example.com/cat.png") == data_url("https://example.com/cat.png")
    assert encode_image("data:image/png;base64,QUJD") == "QUJD"
    with pytest.raises(ValueError, match="no such file"):
        encode_image(str(tmp_path / "missing.png"))
    with pytest.raises(ValueError, match="not a PNG, JPEG"):
        encode_image(b"plain text")
    with pytest.raises(ValueError, match="uint8"):
        encode_image(np.zeros((4, 4, 3), np.float32))


def test_video_frames_are_evenly_spaced():
    video = np.stack([pixels(10 * i) for i in range(10)])
    frames = sample_frames(video, 4)
    assert [int(decode(f)[0, 0, 0]) for f in frames] == [0, 30, 60, 90]
    assert len(sample_frames(video, 50)) == 10  # never more frames than the video has
    assert [int(decode(f)[0, 0, 0]) for f in sample_frames([pixels(1), pixels(2)], 1)] == [1]
    with pytest.raises(ValueError, match="num_frames"):
        sample_frames(video, 0)
    with pytest.raises(ValueError, match=r"\[frames, height, width, channels\]"):
        sample_frames(pixels(1), 2)


@sgl.function
def describe(s, picture, clip):
    s += sgl.user("Look: " + sgl.image(picture) + " and " + sgl.video(clip, 2) + " now.")
    s += sgl.assistant(sgl.gen("what", max_tokens=4))


class ChatFake(FakeBackend):
    is_chat_model = True


def test_a_chat_backend_gets_image_parts_in_the_message():
    backend = ChatFake(reply=lambda prompt, params: "a cat")
    clip = np.stack([pixels(1), pixels(2), pixels(3)])
    state = describe.run(picture=pixels(7), clip=clip, backend=backend)
    assert state["what"] == "a cat"
    ((_, messages, params),) = [c for c in backend.calls if c[0] == "generate"]
    assert "image_data" not in params  # a chat API gets them inside the messages
    user = next(m for m in messages if m["role"] == "user")
    kinds = [p["type"] for p in user["content"]]
    assert kinds == ["text", "image_url", "text", "image_url", "image_url", "text"]
    assert [p["text"] for p in user["content"] if p["type"] == "text"] == ["Look: ", " and ", " now."]
    urls = [p["image_url"]["url"] for p in user["content"] if p["type"] == "image_url"]
    assert all(u.startswith("data:image/png;base64,") for u in urls)
    assert [int(decode(u.split(",", 1)[1])[0, 0, 0]) for u in urls] == [7, 1, 3]
    assert state.text().count("<image>") == 3  # the text keeps one image token per image


def test_a_text_backend_gets_image_data_beside_the_text_and_forks_keep_it():
    backend = FakeBackend()

    @sgl.function
    def prog(s):
        s += "Photo: " + sgl.image(pixels(5)) + "\n"
        forks = s.fork(2)
        for f in forks:
            f += "Caption: " + sgl.gen("c", max_tokens=3)
        forks.join()

    prog.run(backend=backend).sync()
    gens = [c for c in backend.calls if c[0] == "generate"]
    assert len(gens) == 2
    for _, text, params in gens:
        assert text.startswith("Photo: <image>\n")
        assert [int(decode(d)[0, 0, 0]) for d in params["image_data"]] == [5]


def test_select_and_the_fork_hint_after_an_image_carry_the_image():
    @sgl.function
    def prog(s):
        s += sgl.image(pixels(5)) + "Is it red? "
        s += sgl.select("red", choices=["yes", "no"])
        forks = s.fork(2)
        for f in forks:
            f += sgl.gen("x", max_tokens=2)
        forks.join()

    backend = FakeBackend()
    state = prog.run(backend=backend)
    assert state["red"] in ("yes", "no")
    calls = {c[0]: c for c in backend.calls if c[0] in ("cache_prefix", "prompt_logprobs")}
    for kind in ("cache_prefix", "prompt_logprobs"):
        images = [c[-1] for c in backend.calls if c[0] == kind]
        assert images and all(isinstance(i, list) and [int(decode(d)[0, 0, 0]) for d in i] == [5] for i in images)
    assert calls["prompt_logprobs"][1][0][: len("<image>")] == [ord(ch) for ch in "<image>"]


def test_tracing_stops_the_batch_precache_at_the_image():
    @sgl.function
    def prog(s, q):
        s += "A long shared instruction that every program in the batch sends first. " + sgl.image(pixels(1))
        s += q + sgl.gen("a", max_tokens=2)

    graph = prog.trace(backend=FakeBackend(), q="x")
    assert "image" in [n.kind for n in graph.nodes]
    backend = FakeBackend()
    prog.run_batch([{"q": "a"}, {"q": "b"}], backend=backend)
    ((_, prefix),) = [c for c in backend.calls if c[0] == "cache_prefix"]
    assert prefix == "A long shared instruction that every program in the batch sends first. "


def test_the_openai_client_sends_image_parts_on_the_wire():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(
            200,
            json={
                "id": "x",
                "object": "chat.completion",
                "created": 0,
                "model": "m",
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "a dog"}, "finish_reason": "stop"}
                ],
                "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
            },
        )

    transport = httpx.MockTransport(handler)
    backend = sgl.OpenAI("m", base_url="http://fake/v1", http_client=httpx.Client(transport=transport))
    state = describe.run(picture=pixels(9), clip=[pixels(1), pixels(2)], backend=backend)
    assert state["what"] == "a dog"
    user = next(m for m in seen[0]["messages"] if m["role"] == "user")
    assert [p["type"] for p in user["content"]] == ["text", "image_url", "text", "image_url", "image_url", "text"]

    completion = sgl.OpenAI(
        "m", base_url="http://fake/v1", is_chat_model=False, http_client=httpx.Client(transport=transport)
    )

    @sgl.function
    def plain(s):
        s += sgl.image(pixels(1)) + "Caption: " + sgl.gen("c", max_tokens=3)

    with pytest.raises(ProgramError, match="completions API takes text only"):
        plain.run(backend=completion)["c"]
