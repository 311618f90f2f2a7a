"""One request's share of a step (`Work`): what the scheduler plans, the runner packs into the step's buffer, and
the commit reads back. Its own module: the runner and the scheduler both speak it, and neither needs the other."""

from __future__ import annotations

from dataclasses import dataclass, field

from sgjax.engine.request import Req


@dataclass(slots=True)
class Work:
    """One request's share of a step: `tokens` go in at positions start..start+len-1."""

    req: Req
    start: int
    tokens: list[int]
    sample: bool  # the chunk completes the fill: sample the next token from its last row
    completes_fill: bool = False  # a prefill or extend chunk that reaches the end of the fill (not a decode row)
    decode: bool = False  # one decode row: the newest output token of a request whose fill is done
    # speculative decoding: the tokens drafted after the newest output token (which is tokens[0]); each of the
    # chunk's rows samples, and the host keeps the drafted tokens its rows sampled too (commit)
    draft: list[int] = field(default_factory=list)
    draft_results: list = field(default_factory=list)  # (token, logprob, top logprobs) per drafted row, the runner's
    fsm_states: list = field(default_factory=list)  # a constrained draft: the grammar's state at each of its rows
    prompt_rows: list[tuple[int, int]] = field(default_factory=list)  # (row in chunk, target prompt token)
    # (row in chunk, target token, output index): a jump-forward's forced token, whose logprob the extend's rows give
    # at no extra pass; index -1 is a prefill-only request's look at the next token (its top logprobs only)
    output_rows: list[tuple[int, int, int]] = field(default_factory=list)
    target_results: list = field(default_factory=list)  # (logprob, top logprobs) per target row, set by the runner

    @property
    def target_rows(self) -> list[tuple[int, int]]:
        """Every row whose logprob at a target token the step reports: the prompt rows, then the output rows."""
        return self.prompt_rows + [(row, target) for row, target, _ in self.output_rows]
