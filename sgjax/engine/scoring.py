"""SGLang's scoring (Engine.score, /v1/score) for a causal LM, pointwise: for each item, the probability of each
label token as the next token after query + item (item + query with item_first). Text is joined and tokenized
whole, ids are concatenated, as upstream does. Scores are p(label) over the whole vocabulary, or with
apply_softmax a softmax over the labels' log-probabilities divided by temperature."""

from __future__ import annotations

import math
from dataclasses import dataclass

from sgjax.engine.requests import check_token_ids
from sgjax.errors import RequestError


@dataclass(frozen=True)
class Scores:
    scores: list[list[float]]  # [item][label]
    logprobs: list[list[float]]  # log p(label | prompt), before any softmax
    prompt_tokens: int


def prompts(query, items) -> tuple[list, bool]:
    """The items as a list, and whether query and items are text (both text or both ids; else a RequestError)."""
    if items is None:
        raise RequestError("items are required", "items")
    items = [items] if isinstance(items, str) else list(items)
    texts = all(isinstance(x, str) for x in items)
    if query is not None and isinstance(query, str) != texts:
        raise RequestError("give the query and the items both as text or both as token ids", "items")
    return items, texts


def join(query, item, item_first: bool):
    return item + query if item_first else query + item


def labels_per_item(label_token_ids, num_items: int, vocab: int) -> list[list[int]]:
    """One shared list of label ids or one list per item, each nonempty, without duplicates, in the vocabulary."""
    if not label_token_ids:
        raise RequestError("a nonempty list of token ids is required for a causal LM", "label_token_ids")
    per_item = label_token_ids if isinstance(label_token_ids[0], list) else [label_token_ids] * num_items
    if len(per_item) != num_items:
        raise RequestError(f"{len(per_item)} lists for {num_items} items", "label_token_ids")
    for one in per_item:
        if not one or len(set(one)) != len(one) or not all(type(t) is int for t in one):
            raise RequestError("each item needs a nonempty list of distinct integer ids", "label_token_ids")
        check_token_ids(one, vocab, "label_token_ids")
    return per_item


def probabilities(logprobs: list[float], apply_softmax: bool, temperature: float) -> list[float]:
    if not apply_softmax:
        return [math.exp(x) for x in logprobs]
    top = max(logprobs)  # centred first, so a small temperature cannot overflow
    weights = [math.exp((x - top) / temperature) for x in logprobs]
    return [w / sum(weights) for w in weights]


def check_temperature(temperature: float, apply_softmax: bool) -> None:
    if not (math.isfinite(temperature) and temperature > 0):
        raise RequestError("must be finite and greater than zero", "temperature")
    if temperature != 1.0 and not apply_softmax:
        raise RequestError("needs apply_softmax (it scales the softmax over the labels)", "temperature")


def score(
    requests, logprob_rows, query, items, label_token_ids, apply_softmax: bool, item_first: bool, temperature: float
) -> Scores:
    """The whole computation of Engine.score: `requests` (a RequestBuilder) checks and tokenizes the joined
    prompts, `logprob_rows(ids)` runs the scratch prefill ([len(ids), vocab] log-probabilities)."""
    check_temperature(temperature, apply_softmax)
    items, texts = prompts(query, items)
    if not items:
        return Scores([], [], 0)
    query = query if query is not None else ("" if texts else [])
    joined = [join(query, x if texts else list(x), item_first) for x in items]
    ids = requests.whole_prompts(*((joined, None) if texts else (None, joined)))
    labels = labels_per_item(label_token_ids, len(ids), requests.cfg.vocab_size)
    lps = [[float(row[t]) for t in one] for row, one in zip(logprob_rows(ids), labels)]
    return Scores([probabilities(lp, apply_softmax, temperature) for lp in lps], lps, sum(map(len, ids)))
