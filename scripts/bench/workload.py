"""What every benchmark workload module provides: a program, its arguments and how to score the states."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Workload:
    """Arguments and labels are plain JSON data, so a machine without the datasets can run a dumped workload
    (run.py --dump-workloads / --workload-file); the program and the score are the module's own."""

    name: str
    program: object  # an sgl.function
    arguments: list[dict]
    labels: list | None = None  # one per program, for `score`
    # score(states, labels) -> accuracy (or another 0-1 quality measure); None where there is nothing to score
    score: Callable[[list, list | None], float] | None = None
    description: str = ""

    def to_json(self) -> dict:
        return {"name": self.name, "arguments": self.arguments, "labels": self.labels, "description": self.description}

    def subset(self, k: int) -> "Workload":
        return dataclasses.replace(
            self, arguments=self.arguments[:k], labels=None if self.labels is None else self.labels[:k]
        )


def first_number(text: str) -> str | None:
    """The last number in a GSM8K-style answer (commas dropped), or None."""
    nums = re.findall(r"-?\d[\d,]*\.?\d*", text or "")
    return nums[-1].replace(",", "").rstrip(".") if nums else None


def majority(values: list) -> object:
    values = [v for v in values if v is not None]
    return Counter(values).most_common(1)[0][0] if values else None


def sizes(quick: bool, quick_value, full_value):
    return quick_value if quick else full_value


def clip_words(text: str, quick: bool, words: int = 60) -> str:
    """Quick runs (CI, 2 CPU cores) keep passages short: prefill is most of their cost."""
    return " ".join(text.split()[:words]) if quick else text
