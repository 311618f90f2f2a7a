"""Host reference decoding loop: what the scheduler does with a grammar, minus the model.

Used by tests and the benchmark to check that jump-forward changes the number of forward passes and
nothing else; the engine's scheduler follows the same contract (docs/fsm.md).
"""

from __future__ import annotations

from typing import Callable

import numpy as np


def greedy_decode(
    grammar, logits_fn: Callable[[list[int]], np.ndarray], use_jump: bool, max_forwards: int = 300
) -> tuple[list[int], int]:
    """Decode greedily under `grammar`; returns (tokens, forward passes). A jump counts as one forward (an extend)."""
    state, out, forwards = grammar.start, [], 0
    while state != grammar.done and forwards < max_forwards:
        forwards += 1
        if use_jump and (jump := grammar.jump(state)) is not None:
            out += jump.tokens
            state = jump.state
            continue
        allowed = grammar.allowed_tokens(state)
        tok = int(allowed[np.argmax(np.asarray(logits_fn(out))[allowed])])
        out.append(tok)
        state = grammar.next_state(state, tok)
    return out, forwards
