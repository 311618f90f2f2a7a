"""HellaSwag 20-shot: a shared few-shot prefix, then select over the 4 endings (scored with prompt logprobs)."""

from __future__ import annotations

from workload import Workload, sizes

import sgjax as sgl
from sgjax.data import hellaswag


def example(row: dict, ending: str | None) -> str:
    return f"{row['activity_label']}: {row['ctx']}" + (f" {ending}\n\n" if ending is not None else "")


@sgl.function
def few_shot_hellaswag(s, examples, question, choices):
    s += examples + question
    s += sgl.select("answer", choices=choices)


def build(n: int, quick: bool) -> Workload:
    rows = hellaswag()
    shots = sizes(quick, 3, 20)
    examples = "".join(example(r, r["endings"][r["label"]]) for r in rows[-shots:])  # never evaluated below
    evaluated = rows[:n]
    args = [
        {"examples": examples, "question": example(r, None), "choices": [" " + e for e in r["endings"]]}
        for r in evaluated
    ]
    labels = [a["choices"][r["label"]] for a, r in zip(args, evaluated)]
    return Workload("hellaswag", few_shot_hellaswag, args, labels, score, f"{shots}-shot select")


def score(states, labels) -> float:
    return sum(st["answer"] == y for st, y in zip(states, labels)) / len(states)
