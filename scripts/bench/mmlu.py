"""MMLU 5-shot (the paper's Figure 5): one shared few-shot prefix per subject, then gen of one token."""

from __future__ import annotations

from workload import Workload, sizes

import sgjax as sgl
from sgjax.data import mmlu

SUBJECTS = (
    "high_school_biology",
    "college_computer_science",
    "world_religions",
    "us_foreign_policy",
    "astronomy",
    "marketing",
    "nutrition",
    "philosophy",
)
LETTERS = "ABCD"


def format_question(row: dict, with_answer: bool) -> str:
    text = row["question"].strip() + "\n"
    text += "".join(f"{LETTERS[i]}. {c}\n" for i, c in enumerate(row["choices"]))
    return text + "Answer:" + (f" {LETTERS[row['answer']]}\n\n" if with_answer else "")


def few_shot_prefix(subject: str, shots: int = 5) -> str:
    head = f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"
    return head + "".join(format_question(r, True) for r in mmlu("dev", subject)[:shots])


@sgl.function
def few_shot_mmlu(s, examples, question):
    s += examples + question + sgl.gen("answer", max_tokens=1, temperature=0)


def score(states, labels) -> float:
    return sum(st["answer"].strip()[:1] == y for st, y in zip(states, labels)) / len(states)


def build(n: int, quick: bool) -> Workload:
    subjects = SUBJECTS[:1] if quick else SUBJECTS
    per = max(1, n // len(subjects))
    args, labels = [], []
    for subject in subjects:
        prefix = few_shot_prefix(subject, sizes(quick, 2, 5))
        for row in mmlu("test", subject)[:per]:
            args.append({"examples": prefix, "question": format_question(row, False)})
            labels.append(LETTERS[row["answer"]])

    return Workload("mmlu", few_shot_mmlu, args, labels, score, f"{sizes(quick, 2, 5)}-shot, {len(subjects)} subjects")
