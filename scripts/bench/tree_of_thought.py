"""GSM8K tree-of-thought (SGLang's tree_of_thought_deep): plan -> execute -> reflect -> final answer, forking
`branches` ways at each level (2 at 4 levels = 16 leaves), then a majority vote over the leaves' answers."""

from __future__ import annotations

from workload import Workload, first_number, majority, sizes

import sgjax as sgl
from sgjax.data import gsm8k

PLAN = (
    "Please generate a high-level plan for solving the following question. As the first step, just say what "
    "method and idea you will use to solve the question. You can reorganize the information in the question. "
    "Do not do the actual calculation. Keep your response concise and within 80 words. Question: "
)
EXECUTE = (
    "The plan looks good! Now, use real numbers and do the calculation. Please solve the question "
    "step-by-step according to the high-level plan. Give me the final answer. Make your response short."
)
REFLECT = (
    "Okay. Now you evaluate your own solution and give it a score on a scale of 1 to 5. Please do rigorous "
    "check of the correctness."
)
FINAL = "Based on your reflection, do you change your mind? Now, give me the final answer after careful consideration."
STEPS = (("plan", None), ("answer", EXECUTE), ("score", REFLECT), ("final_answer", FINAL))


def expand(states, step: int, branches: int, max_tokens: int, temperature: float):
    """One level of the tree: every state forks `branches` ways and answers the step's question."""
    name, prompt = STEPS[step]
    children = []
    for s in states:
        if prompt is not None:
            s += sgl.user(prompt)
        forks = s.fork(branches)
        forks += sgl.assistant(sgl.gen(name, max_tokens=max_tokens, temperature=temperature))
        children.extend(forks)
    return children


@sgl.function
def tree_search(s, question, branches, depth, max_tokens, temperature):
    s += sgl.user(PLAN + question)
    states = [s]
    for step in range(depth):
        states = expand(states, step, branches, max_tokens, temperature)
    last = STEPS[depth - 1][0]
    return [leaf[last] for leaf in states]  # waits for every branch; run() keeps it as state.ret_value


def score(states, labels) -> float:
    """Majority vote over the leaves' last numbers against GSM8K's short answer."""
    votes = [majority([first_number(t) for t in st.ret_value]) for st in states]
    return sum(v == y for v, y in zip(votes, labels)) / len(states)


def build(n: int, quick: bool) -> Workload:
    rows = gsm8k()[:n]
    branches, depth = sizes(quick, (2, 2), (2, 4))
    max_tokens = sizes(quick, 16, 256)
    args = [
        {"question": r["question"], "branches": branches, "depth": depth, "max_tokens": max_tokens, "temperature": 0.7}
        for r in rows
    ]

    return Workload(
        "tree_of_thought",
        tree_search,
        args,
        [r["short_answer"] for r in rows],
        score,
        f"GSM8K, fork({branches}) x {depth} levels",
    )
