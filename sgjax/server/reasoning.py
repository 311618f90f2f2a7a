"""`--reasoning-parser`: a chat answer's `<think>...</think>` block as `reasoning_content`, the rest as `content`.

The formats and SGLang's model-type names are the DSL's (sgjax/lang/reasoning.py): *forced* types (deepseek-r1,
qwen3-thinking, ...) always reason first and may omit the opening tag, so everything before `</think>` is
reasoning; *optional* types (qwen3, ...) reason only when the answer opens with `<think>`. Here the split also runs
on a stream's growing text: `split(text, final=False)` holds back a possibly unfinished tag, so that both parts
only grow as text is appended and a stream's deltas concatenate to the whole answer's split. The answer loses the
whitespace that follows `</think>` (layout between the parts).
"""

from __future__ import annotations

from dataclasses import dataclass

from sgjax.fsm.structural_tag import _lit, without
from sgjax.lang.reasoning import FORCED, OPTIONAL, THINK_END, THINK_START, is_forced
from sgjax.server.tool_parsers import _held_prefix

NAMES = tuple(sorted(FORCED + OPTIONAL))


@dataclass(frozen=True)
class ReasoningParser:
    forced: bool

    @classmethod
    def named(cls, model_type: str) -> "ReasoningParser":
        return cls(is_forced(model_type))

    def grammar_prefix(self) -> str:
        """Regex of the reasoning block a constrained answer (tool calls) may open with: free text without
        `</think>`, then `</think>` and a little layout. Forced types must write it (their opening tag optional);
        optional types may, opening it with `<think>`. The grammar starts after it, as SGLang leaves reasoning
        sections unconstrained."""
        block = f"{without(THINK_END)}{_lit(THINK_END)}\\s{{0,4}}"
        return f"(?:{_lit(THINK_START)})?{block}" if self.forced else f"(?:{_lit(THINK_START)}{block})?"

    def split(self, text: str, final: bool = True) -> tuple[str, str]:
        """(reasoning, content) of an answer, or of a stream's text so far (final=False)."""
        body = text.lstrip()
        if not final and THINK_START.startswith(body):
            return "", ""  # nothing yet, or an unfinished opening tag
        if body.startswith(THINK_START):
            body = body[len(THINK_START) :]
        elif not self.forced:
            return "", text
        if THINK_END in body:
            reasoning, _, content = body.partition(THINK_END)
            return reasoning, content.lstrip()
        if final:
            return body, ""  # cut off while reasoning
        return body[: len(body) - _held_prefix(body, THINK_END)], ""


class ReasoningStream:
    """`feed(delta)` per new piece of output -> (new reasoning text, new content text). `whole` (SGLang's
    `stream_reasoning: false`): the reasoning is held back and sent in one piece when it ends (`</think>`, or the
    output's end), so a client that shows only finished thoughts gets them as one delta."""

    def __init__(self, parser: ReasoningParser, whole: bool = False):
        self.parser, self.whole, self.text, self.sent = parser, whole, "", ("", "")

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.text += delta
        reasoning, content = self.parser.split(self.text, final)
        old_r, old_c = self.sent
        if self.whole and not final and THINK_END not in self.text:
            reasoning = old_r  # still reasoning: nothing of it yet
        self.sent = (reasoning, content)
        return reasoning[len(old_r) :], content[len(old_c) :]
