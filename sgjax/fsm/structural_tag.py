"""Free text with constrained islands, as regexes: SGLang's structural tags, and `auto` tool calls after text.

A structural tag is free text in which a *trigger* (`<function=`) may only start one of the given structures
(`<function=get_weather>` + JSON of its schema + `</function>`), after which free text resumes. As a regular
language: text that never contains the trigger, then any number of (structure, such text). `without(trigger)` is
the regex of the strings that do not contain the trigger. It is built from the trigger's own matching automaton
(states: how much of the trigger the text ends with), for triggers whose first character does not occur again in
them (`<tool_call>`, `[TOOL_CALLS]`, `<function=`): the automaton then only ever falls back to "nothing matched" or
"the first character matched", and the regex stays linear in the trigger's length.
"""

from __future__ import annotations

import json
import re

from sgjax.fsm.errors import GrammarError
from sgjax.fsm.json_schema import schema_to_regex


def _lit(text: str) -> str:
    return re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", text).replace("\n", "\\n")


def _not(*chars: str) -> str:
    body = "".join("\\" + c if c in "\\]^-[" else ("\\n" if c == "\n" else c) for c in dict.fromkeys(chars))
    return f"[^{body}]"


def without(trigger: str) -> str:
    """Regex of the strings that do not contain `trigger` (its first character must not occur again in it)."""
    if not trigger:
        raise GrammarError("a trigger must not be empty")
    c0, m = trigger[0], len(trigger)
    if c0 in trigger[1:]:
        raise GrammarError(f"trigger {trigger!r}: its first character occurs again in it, which is not supported")
    if m == 1:
        return f"{_not(c0)}*"
    # After c0 (state 1): read trigger[1:i], then a character that is neither trigger[i] nor c0 -> back to state 0;
    # or then c0 again -> state 1; or the text ends part-way (state i).
    exits = "|".join(_lit(trigger[1:i]) + _not(trigger[i], c0) for i in range(1, m))
    again = "|".join(_lit(trigger[1:i]) + _lit(c0) for i in range(1, m))
    ends = "|".join(_lit(trigger[1:i]) for i in range(1, m))
    after_c0 = f"(?:{again})*"
    return f"(?:{_not(c0)}|{_lit(c0)}{after_c0}(?:{exits}))*(?:{_lit(c0)}{after_c0}(?:{ends}))?"


def structural_tag_to_regex(spec) -> str:
    """SGLang's structural tag ({"structures": [{"begin", "schema", "end"}], "triggers": [...]}) as a regex."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise GrammarError(f"not valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise GrammarError("must be an object with structures and triggers")
    structures, triggers = spec.get("structures"), spec.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise GrammarError("structures: a non-empty list of {begin, schema, end}")
    if not isinstance(triggers, list) or len(triggers) != 1 or not isinstance(triggers[0], str):
        raise GrammarError("triggers: exactly one trigger string is supported")
    trigger = triggers[0]
    text = without(trigger)
    alts = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str):
            raise GrammarError(f"structures.{i}: needs begin and end strings and a schema")
        if not s["begin"].startswith(trigger):
            raise GrammarError(f"structures.{i}.begin: must start with the trigger {trigger!r}")
        try:
            body = schema_to_regex(s.get("schema", {}))
        except GrammarError as e:
            raise GrammarError(f"structures.{i}.schema: {e}") from None
        alts.append(_lit(s["begin"]) + f"(?:{body})" + _lit(s["end"]))
    return f"{text}(?:(?:{'|'.join(alts)}){text})*"
