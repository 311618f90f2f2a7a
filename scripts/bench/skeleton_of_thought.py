"""Skeleton-of-thought (SGLang's tip_suggestion): a skeleton of short tips, then every tip expanded in parallel
in its own fork."""

from __future__ import annotations

from workload import Workload, sizes

import sgjax as sgl
from sgjax.data import mmlu_subjects


@sgl.function
def skeleton_of_thought(s, topic, num_tips, tip_tokens, expand_tokens):
    s += sgl.user(f"Give {num_tips} short tips for {topic}. One line each.")
    s += sgl.assistant_begin()
    for i in range(1, num_tips + 1):
        s += f"{i}." + sgl.gen(f"tip_{i}", max_tokens=tip_tokens, stop="\n", temperature=0) + "\n"
    s += sgl.assistant_end()
    forks = s.fork(num_tips)
    for i, f in enumerate(forks, start=1):
        f += sgl.user(f"Expand tip {i} into a short paragraph.")
        f += sgl.assistant(sgl.gen("expansion", max_tokens=expand_tokens, temperature=0))
    return [f["expansion"] for f in forks]


def build(n: int, quick: bool) -> Workload:
    topics = [f"studying {name.replace('_', ' ')}" for name in mmlu_subjects()][:n]
    tips, tip_tokens, expand_tokens = sizes(quick, (3, 12, 24), (5, 24, 128))
    args = [{"topic": t, "num_tips": tips, "tip_tokens": tip_tokens, "expand_tokens": expand_tokens} for t in topics]
    return Workload("skeleton_of_thought", skeleton_of_thought, args, None, None, f"{tips} tips, parallel expansion")
