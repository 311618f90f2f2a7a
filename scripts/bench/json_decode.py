"""JSON decoding (SGLang's json_decode_regex): one constrained gen per field of a JSON object about a Wikipedia
passage, each field its own regex. Jump-forward skips the fixed text inside each field's FSM."""

from __future__ import annotations

import json

from llm_judge import article
from workload import Workload, clip_words

import sgjax as sgl
from sgjax.data import squad

REGEX_STR = r'"[\w\d ,.\-]{1,40}"'
REGEX_INT = r"(-)?(0|[1-9][0-9]{0,3})"
REGEX_CATEGORY = r'"(person|place|organization|event|science|art|other)"'
REGEX_BOOL = r"(true|false)"


@sgl.function
def json_extract(s, passage):
    s += "Read the passage and fill in the JSON object about it.\n\nPassage: " + passage + "\n\n"
    with s.var_scope("json_output"):
        s += "{\n"
        s += '  "subject": ' + sgl.gen("subject", max_tokens=44, regex=REGEX_STR, temperature=0) + ",\n"
        s += '  "category": ' + sgl.gen("category", max_tokens=8, regex=REGEX_CATEGORY, temperature=0) + ",\n"
        s += '  "year": ' + sgl.gen("year", max_tokens=6, regex=REGEX_INT, temperature=0) + ",\n"
        s += '  "mentions_a_person": ' + sgl.gen("person", max_tokens=3, regex=REGEX_BOOL, temperature=0) + ",\n"
        s += '  "place": ' + sgl.gen("place", max_tokens=44, regex=REGEX_STR, temperature=0) + "\n"
        s += "}"


def score(states, labels=None) -> float:
    """The share of outputs that parse as JSON with the five fields (constrained decoding must make it 1)."""
    ok = 0
    for st in states:
        try:
            obj = json.loads(st["json_output"])
            ok += set(obj) == {"subject", "category", "year", "mentions_a_person", "place"}
        except json.JSONDecodeError:
            pass
    return ok / len(states)


def build(n: int, quick: bool) -> Workload:
    docs = [clip_words(a, quick) for a in list({article(d): d for d in squad()}.keys())[:n]]

    return Workload(
        "json_decode",
        json_extract,
        [{"passage": p} for p in docs],
        None,
        score,
        f"5 regex fields{' (quick)' if quick else ''}; accuracy = valid JSON share",
    )
