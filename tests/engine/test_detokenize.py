"""Streamed text must add up exactly: incremental detokenization and stop strings.

A client sees the concatenation of the chunks the engine streams, so (1) the chunks of `IncrementalDecoder` plus its
flush must equal `tokenizer.decode(all_ids)` for any ids and any push chunking, without emitting U+FFFD for
characters that byte-level BPE tokens split (emoji, CJK, accents), at O(1) decode work per token; and (2)
`StopMatcher` must cut the text at the first stop string to complete, whatever the chunking, never emitting part of a
stop string before it is known not to complete. Uses the real SmolLM2 tokenizer (byte-level BPE, 49152 tokens).
"""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sgjax.engine.detokenize import IncrementalDecoder, StopMatcher
from sgjax.model.tokenizer import load_tokenizer

FFFD = "\ufffd"
VOCAB = 49152

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It's 3.14159 and 2024-06-01!",
    "大型语言模型的推理需要高效的调度。我们今天去北京，好吗？",
    "Emoji: 🎉🚀 family 👨‍👩‍👧‍👦 flags 🇯🇵🇫🇷 skin 👍🏽 and ✨ done 😀😀",
    "Crème brûlée, naïve façade, Ærøskøbing, São Paulo, Łódź, Ελληνικά, русский, עברית, العربية",
    "def f(x):\n    return {'a': [1, 2,  3]}\n\n\n\tif x  >  0:  # two  spaces\n        print(x)   \n",
    "mixed: 日本語のテキスト🍣 with ASCII  and   spaces, ü ß ç, 한국어 텍스트 👋🏻\n\n END",
    "  leading spaces, trailing spaces   ",
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def fragment_ids(tok):
    """Ids whose own decode is broken UTF-8 (partial characters): the hard cases for the decoder."""
    return [i for i in range(VOCAB) if FFFD in tok.decode([i])]


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call gets."""

    def __init__(self, tok):
        self.tok, self.sizes = tok, []

    def decode(self, ids, skip_special_tokens=True):
        self.sizes.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def stream(tok, ids, sizes, skip_special_tokens=True):
    dec = IncrementalDecoder(tok, skip_special_tokens=skip_special_tokens)
    chunks, i, k = [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)]
        chunks.append(dec.push(ids[i : i + n]))
        i, k = i + n, k + 1
    tail = dec.flush()
    assert dec.text == "".join(chunks) + tail
    return chunks, tail


def random_sizes(rng, n=50):
    return [rng.choice([1, 1, 1, 2, 3, 5]) for _ in range(n)]


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_real_text_random_chunks(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    rng = random.Random(hash(text) % 1000)
    for trial in range(20):
        sizes = [1] if trial == 0 else random_sizes(rng)
        chunks, tail = stream(tok, ids, sizes)
        assert "".join(chunks) + tail == text
        assert tail == ""  # valid text: nothing held back at the end
        assert all(FFFD not in c for c in chunks)


def test_split_characters_are_held_back(tok):
    text = "🎉世界👨‍👩‍👧‍👦"
    ids = tok.encode(text, add_special_tokens=False)
    assert any(FFFD in tok.decode([i]) for i in ids)  # the tokenizer really splits these characters
    dec = IncrementalDecoder(tok)
    outs = [dec.push([i]) for i in ids]
    assert "" in outs and all(FFFD not in o for o in outs)
    assert "".join(outs) == text and dec.flush() == ""


def test_text_before_a_split_character_is_emitted_at_once(tok):
    ids = tok.encode("hello 🎉", add_special_tokens=False)
    first_broken = next(k for k in range(1, len(ids) + 1) if tok.decode(ids[:k]).endswith(FFFD))
    dec = IncrementalDecoder(tok)
    first = dec.push(ids[:first_broken])
    assert first == tok.decode(ids[:first_broken]).rstrip(FFFD) and first.startswith("hello")
    assert first + dec.push(ids[first_broken:]) + dec.flush() == "hello 🎉" == dec.text


def test_decode_window_stays_small(tok):
    """O(1) per token: every decode call sees a handful of ids, however long the stream."""
    ids = tok.encode("".join(TEXTS) * 4, add_special_tokens=False)
    counting = CountingTokenizer(tok)
    dec = IncrementalDecoder(counting)
    out = "".join(dec.push([i]) for i in ids) + dec.flush()
    assert out == tok.decode(ids)
    assert len(ids) > 500 and max(counting.sizes) <= 8
    assert len(counting.sizes) <= 2 * len(ids) + 1


def test_invalid_ids_flush_and_continue(tok, fragment_ids):
    lead = next(i for i in fragment_ids if tok.decode([i]) == FFFD)  # a token that is an incomplete character
    a = tok.encode("a", add_special_tokens=False)
    dec = IncrementalDecoder(tok)
    assert dec.push(a) == "a"
    assert dec.push([lead]) == ""  # could still complete
    assert dec.flush() == FFFD  # it never did
    ids = a + [lead] + a
    out, tail = stream(tok, ids, [1])
    assert "".join(out) + tail == tok.decode(ids) and FFFD in tok.decode(ids)


def test_special_tokens(tok):
    body = tok.encode("Hi 🎉 there", add_special_tokens=False)
    ids = [1] + body[:2] + [2, 0] + body[2:] + [2]
    for skip in (True, False):
        for sizes in ([1], [2], [3, 1]):
            chunks, tail = stream(tok, ids, sizes, skip_special_tokens=skip)
            assert "".join(chunks) + tail == tok.decode(ids, skip_special_tokens=skip)
    assert "<|im_start|>" in tok.decode(ids, skip_special_tokens=False)


def test_push_int_and_empty(tok):
    dec = IncrementalDecoder(tok)
    assert dec.push([]) == "" and dec.flush() == "" and dec.text == ""
    ids = tok.encode("ok", add_special_tokens=False)
    assert "".join(dec.push(i) for i in ids) == "ok"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_ids_concatenate_to_decode(tok, fragment_ids, data):
    """Any ids (broken UTF-8 included; half are drawn from partial-character tokens) and any chunking."""
    any_id = st.integers(0, VOCAB - 1)
    ids = data.draw(st.lists(st.one_of(any_id, st.sampled_from(fragment_ids)), max_size=40), label="ids")
    sizes = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=10), label="sizes")
    skip = data.draw(st.booleans(), label="skip")
    chunks, tail = stream(tok, ids, sizes, skip_special_tokens=skip)
    full = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(chunks) + tail == full
    if FFFD not in full:
        assert tail == ""


# ---- stop strings


def run_matcher(stops, pieces, no_stop_trim=False):
    m = StopMatcher(stops, no_stop_trim=no_stop_trim)
    out = []
    for p in pieces:
        safe, matched = m.feed(p)
        out.append(safe)
        if matched is not None:
            assert m.done and m.matched == matched
            assert m.feed("more") == ("", None) and m.finish() == ""
            return "".join(out), matched
    out.append(m.finish())
    return "".join(out), None


def reference(stops, text, no_stop_trim=False):
    """The stop that completes first in the text (the longest of those completing at once)."""
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not hits:
        return text, None
    end, start, s = min(hits)
    return text[: end if no_stop_trim else start], s


def random_chunks(rng, text):
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        out.append(text[i : i + n])
        i += n
    return out


CASES = [
    (["</s>"], "hello </s> world"),
    (["\n\n"], "line one\nline two\n\nline three"),
    (["STOP"], "no stop here, just STO and ST and S"),
    (["world", "lo"], "hello world"),
    (["abcd", "c"], "xxabcd"),
    (["bc", "abc"], "xabcx"),
    (["aab"], "aaaab"),
    (["ab", "ba"], "aaaabab"),
    (["🎉", "終わり"], "日本語 終わり 🎉"),
    (["x"], ""),
]


@pytest.mark.parametrize("stops,text", CASES)
@pytest.mark.parametrize("no_stop_trim", [False, True])
def test_stop_chunkings_agree(stops, text, no_stop_trim):
    want = reference(stops, text, no_stop_trim)
    rng = random.Random(0)
    assert run_matcher(stops, list(text), no_stop_trim) == want  # character by character
    assert run_matcher(stops, [text], no_stop_trim) == want
    for _ in range(20):
        assert run_matcher(stops, random_chunks(rng, text), no_stop_trim) == want
        assert run_matcher(stops[::-1], random_chunks(rng, text), no_stop_trim) == want  # order of stops: no matter


def test_stop_across_chunks():
    m = StopMatcher(["</answer>"])
    assert m.feed("The answer is 42<") == ("The answer is 42", None)
    assert m.feed("/ans") == ("", None)
    assert m.feed("wer> trailing") == ("", "</answer>")
    assert m.matched == "</answer>" and m.done


def test_stop_no_trim():
    m = StopMatcher(["END"], no_stop_trim=True)
    assert m.feed("abc E") == ("abc ", None)
    assert m.feed("NDxyz") == ("END", "END")


def test_earliest_match_wins():
    assert run_matcher(["world", "lo"], ["hello world"]) == ("hel", "lo")
    assert run_matcher(["lo", "world"], ["hello world"]) == ("hel", "lo")
    assert run_matcher(["abc", "bc"], ["xabc"]) == ("x", "abc")  # completing at once: the longer one


def test_held_prefix_released():
    m = StopMatcher(["</end>"])
    assert m.feed("foo </e") == ("foo ", None)
    assert m.feed("x") == ("</ex", None)  # cannot be the stop any more
    assert m.feed("</en") == ("", None)
    assert m.finish() == "</en"  # generation ended for another reason
    assert m.feed("d>") == ("", None)


def test_stop_never_completes():
    text = "a long text that mentions STO, ST, S and STOp but never the stop"
    out, matched = run_matcher(["STOP"], list(text))
    assert matched is None and out == text


def test_no_stops_pass_through():
    m = StopMatcher([])
    assert m.feed("anything") == ("anything", None) and m.finish() == ""


@settings(max_examples=300, deadline=None)
@given(
    stops=st.lists(st.text("ab", min_size=1, max_size=4), min_size=1, max_size=3),
    text=st.text("abc", max_size=20),
    cuts=st.lists(st.integers(1, 5), min_size=1, max_size=8),
    no_stop_trim=st.booleans(),
)
def test_stop_random(stops, text, cuts, no_stop_trim):
    pieces, i, k = [], 0, 0
    while i < len(text):
        pieces.append(text[i : i + cuts[k % len(cuts)]])
        i, k = i + cuts[k % len(cuts)], k + 1
    m = StopMatcher(stops, no_stop_trim=no_stop_trim)
    emitted, fed, matched = "", "", None
    for p in pieces:
        safe, matched = m.feed(p)
        emitted, fed = emitted + safe, fed + p
        if matched is not None:
            break
        # held back: exactly the longest tail that is still a proper prefix of a stop string
        assert fed.startswith(emitted)
        held = fed[len(emitted) :]
        assert held == "" or any(s.startswith(held) for s in stops)
        assert not any(s.startswith(fed[j:]) for s in stops for j in range(len(emitted)))
    if matched is None:
        emitted += m.finish()
    assert (emitted, matched) == reference(stops, text, no_stop_trim)
