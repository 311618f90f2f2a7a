"""A ReAct-style agent (SGLang's react): multi-step thought / action / observation with a growing history. As in
SGLang's benchmark the environment is replayed: each step's observation is the next sentence of the Wikipedia
passage that answers the question (SQuAD), so every program's history grows by model text plus real text."""

from __future__ import annotations

import ast
import re

from llm_judge import article
from workload import Workload, sizes

import sgjax as sgl
from sgjax.data import squad

INSTRUCTIONS = (
    "Solve a question answering task with interleaving Thought, Action, Observation steps. Thought can reason about "
    "the current situation, and Action can be two types: (1) Search[entity], which searches the entity on Wikipedia "
    "and returns the next sentence of its article. (2) Finish[answer], which returns the answer and finishes.\n\n"
)


def question(doc: dict) -> str:
    return doc["query"].split("\nQuestion:", 1)[-1].split("\nAnswer:", 1)[0].strip()


@sgl.function
def react_agent(s, question, title, observations, thought_tokens):
    s += INSTRUCTIONS + f"Question: {question}\n"
    for i, observation in enumerate(observations, start=1):
        s += f"Thought {i}:" + sgl.gen(f"thought_{i}", max_tokens=thought_tokens, stop="\n", temperature=0) + "\n"
        s += f"Action {i}: Search[{title}]\nObservation {i}: {observation}\n"
    i = len(observations) + 1
    s += f"Thought {i}: I can answer now.\nAction {i}: Finish[" + sgl.gen(
        "answer", max_tokens=thought_tokens, stop="]", temperature=0
    )


def contains_gold(states, labels) -> float:
    """The answer contains one of the gold answers (SQuAD's lenient match)."""
    return sum(any(a in st["answer"].lower() for a in golds) for st, golds in zip(states, labels)) / len(states)


def build(n: int, quick: bool) -> Workload:
    steps, thought_tokens = sizes(quick, (2, 12), (4, 48))
    docs, seen = [], set()
    for d in squad():
        if d["title"] not in seen:
            seen.add(d["title"])
            docs.append(d)
    args, answers = [], []
    for d in docs[:n]:
        sentences = [x.strip() for x in re.split(r"(?<=[.!?])\s+", article(d)) if x.strip()]
        args.append(
            {
                "question": question(d),
                "title": d["title"].replace("_", " "),
                "observations": sentences[:steps],
                "thought_tokens": thought_tokens,
            }
        )
        answers.append([a.lower() for a in eval_answers(d)])

    return Workload("react", react_agent, args, answers, contains_gold, f"{steps} steps, replayed observations")


def eval_answers(doc: dict) -> list[str]:
    answers = doc["answers_text"]
    return list(ast.literal_eval(answers) if isinstance(answers, str) else answers)
