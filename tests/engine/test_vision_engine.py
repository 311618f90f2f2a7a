"""The Engine on a vision-language model: a tiny random LLaVA checkpoint (tests/model/test_vision.py) through
Engine.generate with image_data gives HF transformers' greedy tokens, with the image split across prefill chunks;
image pages are cached per image; bad image inputs are refused by name."""

import base64

import numpy as np
import pytest
import torch

from sgjax.engine.engine import Engine
from sgjax.model import vision as V
from tests.llava_tiny import IMAGE_TOKEN, picture, png  # the checkpoint itself: the session fixture `llava`

TEXT = [5, 17, 33, 48, 90, 12, 7, 250, 61, 3, 99, 140, 18, 21, 77, 8]
NEW = 8


def prompt() -> list[int]:
    return TEXT[:9] + [IMAGE_TOKEN] + TEXT[9:]  # the image's 16 rows start at position 9


@pytest.fixture(scope="module")
def engine(llava):
    # chunks of 16 tokens cut the image's rows (positions 9-24) across two prefill steps
    with Engine(
        llava[0],
        skip_tokenizer_init=True,
        max_total_tokens=2048,
        chunked_prefill_size=16,
        max_running_requests=4,
        context_length=256,
    ) as eng:
        yield eng


def hf_greedy(llava, pixels: np.ndarray) -> list[int]:
    _, hf, (_, _, vcfg, _) = llava
    ids = TEXT[:9] + [IMAGE_TOKEN] * vcfg.num_image_tokens + TEXT[9:]
    px = torch.from_numpy(V.preprocess(pixels, vcfg)[None])
    with torch.no_grad():
        out = hf.generate(
            input_ids=torch.tensor([ids]),
            pixel_values=px,
            max_new_tokens=NEW,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def test_greedy_tokens_equal_hf_and_image_pages_are_cached_per_image(engine, llava):
    greedy = {"max_new_tokens": NEW, "temperature": 0}
    a, b = picture(1), picture(2)
    want_a, want_b = hf_greedy(llava, a), hf_greedy(llava, b)
    assert want_a != want_b  # the image decides the answer, so the test can fail
    engine.flush_cache()
    first = engine.generate(input_ids=prompt(), sampling_params=greedy, image_data=[png(a)])
    assert first["output_ids"] == want_a
    encoded = engine.images.encoded
    again = engine.generate(input_ids=prompt(), sampling_params=greedy, image_data=[png(a)])
    assert again["output_ids"] == want_a and again["meta_info"]["cached_tokens"] == 16  # the page holding the image
    assert engine.images.encoded == encoded  # the features came from the encoder's cache
    other = engine.generate(input_ids=prompt(), sampling_params=greedy, image_data=[png(b)])
    assert other["output_ids"] == want_b and other["meta_info"]["cached_tokens"] == 0  # another image: no match
    assert engine.images.encoded == encoded + 1
    both = engine.generate(
        input_ids=[prompt(), prompt()], sampling_params=greedy, image_data=[[png(b)], [png(a)]]
    )  # one batch, one image each
    assert [o["output_ids"] for o in both] == [want_b, want_a] and engine.images.encoded == encoded + 1


def test_the_feature_cache_evicts_the_least_recent_image_and_gives_the_same_rows(llava):
    from sgjax.engine.images import ImageEncoder

    _, _, (_, _, vcfg, vweights) = llava
    encoder = ImageEncoder(vcfg, vweights, cache_size=2)
    ids = prompt()
    rows = {k: encoder.prepare(ids, [png(picture(k))], 320)[1].features for k in (1, 2)}
    assert encoder.encoded == 2
    assert (encoder.prepare(ids, [png(picture(1))], 320)[1].features == rows[1]).all() and encoder.encoded == 2
    encoder.prepare(ids, [png(picture(3))], 320)  # evicts image 2, the least recently used
    assert encoder.encoded == 3
    encoder.prepare(ids, [png(picture(1))], 320)
    assert encoder.encoded == 3
    two, three = encoder.prepare(ids + ids, [png(picture(2)), png(picture(3))], 320)[1].features.reshape(2, -1, 64)
    assert encoder.encoded == 4 and (two == rows[2]).all()  # image 2 encoded again, image 3 from the cache


def test_bad_images_are_refused_by_name(engine):
    with pytest.raises(ValueError, match=r"image_data: 2 image\(s\) but the prompt has 1 image tokens"):
        engine.generate(input_ids=prompt(), image_data=[png(picture(1)), png(picture(2))])
    with pytest.raises(ValueError, match=r"image_data\[0\]: not valid base64"):
        engine.generate(input_ids=prompt(), image_data=["%%%"])
    with pytest.raises(ValueError, match=r"image_data\[0\]: not an image file"):
        engine.generate(input_ids=prompt(), image_data=[base64.b64encode(b"hello").decode()])
    with pytest.raises(ValueError, match=r"image_data\[0\]: URLs are not fetched"):
        engine.generate(input_ids=prompt(), image_data=["https://example.com/a.png"])
    assert engine.generate(input_ids=TEXT, sampling_params={"max_new_tokens": 2})["output_ids"]  # still serving


def test_bf16_native_step_takes_the_image_rows(llava):
    """bf16 matrices on a CPU run the native kernel's step (engine/plan.py): its embeddings take the image's
    feature rows, so the image decides the tokens, and a repeat gives the same tokens."""
    greedy = {"max_new_tokens": NEW, "temperature": 0}
    with Engine(
        llava[0],
        skip_tokenizer_init=True,
        max_total_tokens=2048,
        chunked_prefill_size=16,
        max_running_requests=4,
        context_length=256,
        weight_dtype="bfloat16",
    ) as eng:
        outs = [
            eng.generate(input_ids=prompt(), sampling_params=greedy, image_data=[png(picture(k))])["output_ids"]
            for k in (1, 2, 1)
        ]
        plan = eng.plan
    assert plan.weight_dtype == "bfloat16"
    assert outs[0] != outs[1] and outs[0] == outs[2]
