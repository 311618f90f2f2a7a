"""Multi-turn chat (SGLang's multi_turn_chat): 4 turns, each adding 256-512 tokens of user text from ShareGPT,
answers of 4-8 tokens (short) or 256-512 (long) with ignore_eos. Each turn reuses the previous turns' KV."""

from __future__ import annotations

import random

from workload import Workload, sizes

import sgjax as sgl
from sgjax.data import sharegpt


@sgl.function
def multi_turn(s, turns, answer_tokens):
    for text, n in zip(turns, answer_tokens):
        s += sgl.user(text)
        s += sgl.assistant(sgl.gen(max_tokens=n, ignore_eos=True, temperature=0))


def _texts(tokenizer_words: int) -> list[str]:
    words = [w for conv in sharegpt(400) for turn in conv.get("conversations", []) for w in turn["value"].split()]
    return [" ".join(words[i : i + tokenizer_words]) for i in range(0, len(words) - tokenizer_words, tokenizer_words)]


def build(n: int, quick: bool, long: bool = False) -> Workload:
    rng = random.Random(0)
    # ~0.75 words per token: 256-512 tokens of input per turn is ~190-380 words
    lo, hi = sizes(quick, (48, 96), (190, 380))
    chunks = _texts(hi)
    if long:
        a_lo, a_hi = sizes(quick, (16, 32), (256, 512))
    else:
        a_lo, a_hi = 4, 8
    args = []
    for _ in range(n):
        turns = [" ".join(rng.choice(chunks).split()[: rng.randint(lo, hi)]) for _ in range(4)]
        args.append({"turns": turns, "answer_tokens": [rng.randint(a_lo, a_hi) for _ in range(4)]})
    name = "multi_turn_long" if long else "multi_turn_short"
    return Workload(name, multi_turn, args, None, None, f"4 turns, answers {a_lo}-{a_hi} tokens")
