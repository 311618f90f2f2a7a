"""A request's life in the runtime: what it asked for, where its KV lives, what it produced.

State machine: waiting -> running (prefill chunks, then decode) -> finished; running -> waiting again when the
scheduler retracts it to free memory (it keeps its output and resumes by prefilling prompt + output, usually from
the cache). `fill_ids` are the tokens whose KV a running request must hold: the prompt plus every output token
except the newest, whose KV is computed by the next decode step.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from sgjax.cache.allocator import EMPTY_PAGES

_arrivals = itertools.count()


@dataclass
class Req:
    rid: str
    input_ids: list[int]
    params: Any  # SamplingParams
    seed: int  # int32 seed of the sampler's per-request key
    return_logprob: bool = False
    logprob_start_len: int = -1  # first prompt position whose logprob is reported; -1: none (output only)
    top_logprobs_num: int = 0
    extra_key: Any = None  # radix namespace (image hash, adapter)
    sink: Callable | None = None  # called by the engine with (req, new_text, finished)
    arrival: int = field(default_factory=lambda: next(_arrivals))

    output_ids: list[int] = field(default_factory=list)
    finish_reason: dict | None = None

    # KV state (owned by the scheduler)
    pages: np.ndarray = field(default_factory=lambda: EMPTY_PAGES)  # page table: tree pages, then own pages
    tree_pages: int = 0  # leading pages owned by the cache and protected by the lock on `last_node`
    last_node: Any = None
    kv_len: int = 0  # tokens of fill_ids whose KV is in `pages`
    draft_kv_len: int = 0  # STANDALONE speculation: tokens whose KV the draft model holds (its pool, same pages)
    prefill_done: bool = False  # the prompt (plus any resumed output) has been prefilled at least once
    # a chunk of its fill is in a step committed ahead (the overlap loop): its pages enter the cache at the real commit
    fill_in_flight: bool = False
    slot: int = -1  # while running: where the device keeps its newest sampled token (Runner.future)
    generation: int = 0  # the weights its KV was computed with (Scheduler.generation when it last had none)
    match: Any = None  # while waiting: (limit, MatchResult, cache clock) of its last match: reused or resumed

    # reporting
    cached_tokens: int = -1  # prefix hit at first admission (-1: not admitted yet)
    input_logprobs: list = field(default_factory=list)  # (logprob | None, token_id), from logprob_start_len
    input_top_logprobs: list = field(default_factory=list)
    output_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    text: str = ""  # emitted (stop-safe) text
    decoder: Any = None
    stops: Any = None
    retractions: int = 0
    # speculative decoding: the draft planned for the next step, tokens the last commit added (outputs.on_token
    # checks each), and the verify steps and accepted drafted tokens so far
    draft: list = field(default_factory=list)
    draft_states: list = field(default_factory=list)  # a grammar's state at each of the draft's rows
    new_tokens: int = 1
    spec_steps: int = 0
    spec_accepted: int = 0

    # constrained decoding (sgjax.fsm): the compiled grammar and the FSM state after the output so far
    grammar: Any = None
    fsm_state: int = 0
    jump_tokens: int = 0  # output tokens appended by jump-forward instead of decoded one by one
    # forced tokens at the end of output_logprobs still waiting for the logprob their extend's rows give
    # (scheduler._output_rows); a stream shows their entries once they have it
    forced_pending: int = 0
    # the reason a request that asked for logprobs finishes with, held while the extend of its last forced tokens runs
    finish_after_fill: dict | None = None
    min_tokens_stops: tuple = ()  # EOS (unless ignore_eos) and stop_token_ids: masked while short of min_new_tokens

    images: Any = None  # sgjax.engine.images.RequestImages: feature rows at image positions (vision models)
    adapter: Any = None  # model/lora.Adapter of a LoRA request (its KV's radix namespace too), None: the base model
    lora_slot: int = -1  # while running with an adapter: its slot in the step's stacks (engine/adapters.py)
    bootstrap: Any = None  # prefill/decode disaggregation: (prefill host, bootstrap port, room) (engine/disagg.py)
    export_room: int | None = None  # a prefill worker's request: its prompt's pages are kept for this room

    @property
    def input_array(self) -> np.ndarray:
        """The prompt as int32, built once: matching a long waiting prompt every step must not rebuild it."""
        arr = self.__dict__.get("_input_array")
        if arr is None:
            arr = self.__dict__["_input_array"] = np.asarray(self.input_ids, np.int32)
        return arr

    @property
    def fill_ids(self) -> list[int]:
        if self.prefill_done and self.output_ids:
            return self.input_ids + self.output_ids[:-1]
        return self.input_ids + self.output_ids

    def fill_prefix(self, n: int) -> np.ndarray:
        """The first n fill tokens as int32: a view of the prompt's array while they are all prompt (the cache's
        match and insert take arrays; converting a long list each time was most of their cost)."""
        if n <= len(self.input_ids):
            return self.input_array[:n]
        return np.asarray(self.fill_ids[:n], np.int32)

    @property
    def fill_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids) - (1 if self.prefill_done and self.output_ids else 0)

    @property
    def in_decode(self) -> bool:
        return self.prefill_done and self.kv_len == self.fill_len

    @property
    def own_pages(self) -> np.ndarray:
        return self.pages[self.tree_pages :]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0 and not self.input_logprobs_complete

    @property
    def input_logprobs_complete(self) -> bool:
        return len(self.input_logprobs) >= len(self.input_ids) - max(self.logprob_start_len, 0)

    @property
    def remaining_new_tokens(self) -> int:
        return max(self.params.max_new_tokens - len(self.output_ids), 0)
