"""LLM judge, branch-solve-merge (SGLang's llm_judge): fork(6), one judging dimension per branch, then merge the
judgments into a score. The articles are Wikipedia paragraphs (SQuAD)."""

from __future__ import annotations

from workload import Workload, clip_words, sizes

import sgjax as sgl
from sgjax.data import squad

DIMENSIONS = (
    "Content: Is the information accurate, relevant and complete?",
    "Organization: Is the text well structured, with a clear flow of ideas?",
    "Language: Is the language clear, precise and appropriate for the audience?",
    "Grammar: Are the sentences grammatical and well punctuated?",
    "Vocabulary: Is the choice of words varied and fitting?",
    "Spelling: Are the words spelled correctly?",
)


def article(doc: dict) -> str:
    return doc["query"].split("Background:", 1)[-1].split("\nQuestion:", 1)[0].strip()


@sgl.function
def multi_dimension_judge(s, article, judge_tokens):
    s += sgl.system("You are an expert judge of writing quality.")
    s += sgl.user("Please evaluate the following article.\n\n" + article)
    s += sgl.assistant("Sure, I will evaluate it dimension by dimension.")
    forks = s.fork(len(DIMENSIONS))
    for f, dim in zip(forks, DIMENSIONS):
        f += sgl.user(dim + " Give a short judgment and end it with the word END.")
        f += sgl.assistant("Judgment:" + sgl.gen("judgment", max_tokens=judge_tokens, stop="END", temperature=0))
    s += sgl.user(
        "Summarize the judgments:\n"
        + "".join(f"{dim.split(':')[0]}: {f['judgment'].strip()}\n" for f, dim in zip(forks, DIMENSIONS))
        + "On a scale of 1 to 10, what score does the article get?"
    )
    s += sgl.assistant("The score is" + sgl.gen("score", max_tokens=2, temperature=0))


def build(n: int, quick: bool) -> Workload:
    docs = [clip_words(a, quick) for a in list({article(d): d for d in squad()}.keys())[:n]]
    tokens = sizes(quick, 16, 128)
    return Workload(
        "llm_judge",
        multi_dimension_judge,
        [{"article": a, "judge_tokens": tokens} for a in docs],
        None,
        None,
        "fork(6) branch-solve-merge",
    )
