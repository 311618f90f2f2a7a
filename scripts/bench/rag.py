"""A DSPy-style RAG pipeline (the paper's DSPy workload, without DSPy or a remote retriever): BM25 retrieval of 3
Wikipedia passages (SQuAD and BoolQ, ~4,000), DSPy's ChainOfThought prompt format with one shared demonstration
(what BootstrapFewShot compiles), then reasoning and a short answer."""

from __future__ import annotations

import math
import re
from collections import Counter

import numpy as np
from llm_judge import article
from react import contains_gold, eval_answers, question
from workload import Workload, clip_words, sizes

import sgjax as sgl
from sgjax.data import boolq, squad

HEADER = (
    "Answer questions with short factoid answers.\n\n---\n\nFollow the following format.\n\n"
    "Context: may contain relevant facts\n\nQuestion: ${question}\n\n"
    "Reasoning: Let's think step by step in order to ${produce the answer}. We ...\n\n"
    "Answer: often between 1 and 5 words\n\n---\n\n"
)


def tokens(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


class BM25:
    """Okapi BM25 (k1 1.5, b 0.75) over a fixed corpus, scored with numpy over a sparse term index."""

    def __init__(self, docs: list[str], k1: float = 1.5, b: float = 0.75):
        self.docs = docs
        counts = [Counter(tokens(d)) for d in docs]
        lengths = np.array([sum(c.values()) for c in counts], dtype=np.float64)
        self.norm = k1 * (1 - b + b * lengths / lengths.mean())
        self.k1 = k1
        self.postings: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        by_term: dict[str, list[tuple[int, int]]] = {}
        for i, c in enumerate(counts):
            for term, tf in c.items():
                by_term.setdefault(term, []).append((i, tf))
        n = len(docs)
        self.idf = {}
        for term, rows in by_term.items():
            ids, tfs = zip(*rows)
            self.postings[term] = (np.array(ids), np.array(tfs, dtype=np.float64))
            self.idf[term] = math.log(1 + (n - len(ids) + 0.5) / (len(ids) + 0.5))

    def top(self, query: str, k: int) -> list[str]:
        scores = np.zeros(len(self.docs))
        for term in set(tokens(query)):
            if term in self.postings:
                ids, tf = self.postings[term]
                scores[ids] += self.idf[term] * tf * (self.k1 + 1) / (tf + self.norm[ids])
        return [self.docs[i] for i in np.argsort(-scores, kind="stable")[:k]]


def context_block(passages: list[str]) -> str:
    return "Context:\n" + "".join(f"[{i}] «{p}»\n" for i, p in enumerate(passages, start=1))


@sgl.function
def rag(s, demo, context, question, reason_tokens):
    s += HEADER + demo + "---\n\n" + context + f"\nQuestion: {question}\n\n"
    s += (
        "Reasoning: Let's think step by step in order to"
        + sgl.gen("reasoning", max_tokens=reason_tokens, stop="\n", temperature=0)
        + "\n\n"
    )
    s += "Answer:" + sgl.gen("answer", max_tokens=12, stop="\n", temperature=0)


def build(n: int, quick: bool) -> Workload:
    docs = squad()
    corpus = list(dict.fromkeys([article(d) for d in docs] + [r["passage"] for r in boolq()]))
    index = BM25(corpus)
    demo_doc, evaluated = docs[0], docs[1 : 1 + n]
    k = sizes(quick, 1, 3)

    def retrieve(q):
        return [clip_words(p, quick) for p in index.top(q, k)]

    demo = (
        context_block(retrieve(question(demo_doc))) + f"\nQuestion: {question(demo_doc)}\n\n"
        f"Reasoning: Let's think step by step in order to find the answer. The context says so.\n\n"
        f"Answer: {eval_answers(demo_doc)[0]}\n\n"
    )
    reason_tokens = sizes(quick, 16, 64)
    args = [
        {
            "demo": demo,
            "context": context_block(retrieve(question(d))),
            "question": question(d),
            "reason_tokens": reason_tokens,
        }
        for d in evaluated
    ]
    golds = [[a.lower() for a in eval_answers(d)] for d in evaluated]
    return Workload("rag", rag, args, golds, contains_gold, "BM25 top-3 + one shared demo, ChainOfThought")
