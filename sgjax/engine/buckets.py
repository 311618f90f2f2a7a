"""How a batch's sizes round up to a compiled step shape: tokens T, requests R, logits rows L, top-logprobs K.

Two ladders (the step plan's `buckets`). `fine` (CPU) sizes T (from 1 row), R, L, K and the page-table width P to
the batch: a CPU compile is cheap (the layers are scanned) and padding costs CPU time. `coarse` (accelerators) makes
the shape a function of T alone plus switches: R = min(T, max requests), L = R or T (T only when prompt logprobs
outnumber R), K 0 or the maximum, P the whole context, mask words 0 or the whole vocabulary, the sampler's filters on
or off (engine/sampler.py `Branches`: no device predicate in an accelerator's step). A GPU compile costs seconds
and programs submit asynchronously, so the fine ladder met new (T, R, L, K) combinations in the middle of timed
runs; the coarse ladder has at most 4 shapes per T, all compiled at start. Its padding is cheap on a GPU
(docs/journal: a few percent of a decode step).
"""

from __future__ import annotations

from dataclasses import dataclass

from sgjax.engine.sampler import Branches


def bucket(n: int, minimum: int, factor: int = 2) -> int:
    b = minimum
    while b < n:
        b *= factor
    return b


@dataclass(frozen=True)
class Buckets:
    """How a batch's sizes round up to a compiled shape (see the module docstring)."""

    coarse: bool
    max_reqs: int  # the most requests a step can hold (coarse: R's ceiling)
    max_top_logprobs: int

    def tokens(self, num_tokens: int) -> int:
        """T. Fine (CPU) from 1 row: a CPU step pays for its padded rows' products."""
        return bucket(num_tokens, 16 if self.coarse else 1)

    def reqs(self, num_tokens: int, num_reqs: int) -> int:
        if not self.coarse:
            return bucket(num_reqs, 4)
        return max(min(num_tokens, bucket(self.max_reqs, 4)), bucket(num_reqs, 4))

    def logits(self, num_rows: int, num_reqs: int, num_tokens: int) -> int:
        if not self.coarse:  # from 1 row, as T: one stream's LM head is a matrix-vector product too
            return bucket(max(num_rows, 1), 1)
        return num_reqs if num_rows <= num_reqs else num_tokens

    def top(self, wanted: int) -> int:
        if not wanted:
            return 0
        if self.coarse:  # one K > 0 on an accelerator: a top-k of 20 costs about what a top-k of 1 does
            return self.max_top_logprobs
        return bucket(min(wanted, self.max_top_logprobs), 1)

    def branches(self, filters: bool) -> Branches:
        """Accelerators fix the sampler's optional parts in the shape (a device predicate would make the dispatch
        wait for the forward); a CPU decides them on the device (engine/sampler.py)."""
        return Branches.for_step(self.coarse, filters)

    def tokens_ladder(self, max_tokens: int) -> list[int]:
        """Every T bucket up to the one holding max_tokens (what precompilation walks)."""
        out = [16]
        while out[-1] < max_tokens:
            out.append(out[-1] * 2)
        return out
