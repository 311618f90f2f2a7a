"""What the engine loop does with a request's new tokens: the FSM, stop checks, detokenization, streaming,
jump-forward and finishing; and the result dicts callers get (SGLang's `text`, `output_ids`, `meta_info`).

Runs on the engine thread only. A sink (set by the caller's API: a blocking wait, a stream, an asyncio future) is
called with (req, new_text, finished) whenever a request has new safe text or finishes.
"""

from __future__ import annotations

import time

from sgjax.engine.detokenize import IncrementalDecoder, StopMatcher
from sgjax.engine.request import Req
from sgjax.errors import ABORT_STATUS


def abort_reason(message: str | None = None, kind: str | None = None) -> dict:
    """An abort's finish reason; one that carries a message names what failed it with an HTTP-style status
    (`ABORT_STATUS` of the error kind), as SGLang's FINISH_ABORT does. A plain abort (the client's) has neither."""
    reason = {"type": "abort"}
    if message is not None:
        reason.update(message=message, status_code=ABORT_STATUS[kind])
    return reason


class Outputs:
    def __init__(self, scheduler, tokenizer, eos_ids: frozenset, jump_forward: bool, on_finish=None):
        self.scheduler, self.tokenizer, self.eos_ids, self.jump_forward = scheduler, tokenizer, eos_ids, jump_forward
        self.on_finish = on_finish  # called with every finished request (the engine forgets its id)
        self.sampled_tokens = 0
        self.jumped_tokens = 0
        self.detokenize_seconds = 0.0  # host time between steps (docs/server.md)

    def start(self, req: Req) -> bool:
        """A new request's decoder and stop matcher, and the grammar's forced text before its first token. True when
        that already finished it."""
        if self.tokenizer is not None:
            req.decoder = IncrementalDecoder(self.tokenizer, req.params.skip_special_tokens)
        req.stops = StopMatcher(req.params.stop, req.params.no_stop_trim, req.params.stop_regex)
        return req.grammar is not None and self.jump(req)

    def on_token(self, req: Req) -> None:
        """Stop checks, the FSM and streaming for a request that got a token (or finished a prefill-only run)."""
        if req.finish_after_fill is not None:  # the forced tokens' logprobs are in: finish as decided
            self.finish(req, req.finish_after_fill)
            return
        if req.params.max_new_tokens == 0:
            self.finish(req, {"type": "length", "length": 0})
            return
        count, req.new_tokens = req.new_tokens, 1
        finished = self._verified(req, count) if count > 1 else self._take(req, req.output_ids[-1])
        if not finished and req.grammar is not None:
            self.jump(req)

    def _take(self, req: Req, token: int) -> bool:
        """One new token (already on output_ids): the FSM, then the stop checks. True when the request finished."""
        self.sampled_tokens += 1
        if req.grammar is not None:
            req.fsm_state = req.grammar.next_state(req.fsm_state, token)
            if req.fsm_state < 0:  # the mask forbade it: only an all-masked row (a broken grammar) gets here
                self.finish(req, abort_reason(f"token {token} violates the grammar", "internal"))
                return True
        return self.check_stop(req, [token])

    def _verified(self, req: Req, count: int) -> bool:
        """A verified draft's tokens (speculative decoding), checked one at a time as decoding them would: a stop
        among them ends the output there, and the KV of the tokens dropped after it is not the request's."""
        new = req.output_ids[-count:]
        del req.output_ids[-count:]
        logprobs = req.output_logprobs[-count:] if req.return_logprob else None
        if logprobs is not None:
            tops = req.output_top_logprobs[-count:]
            del req.output_logprobs[-count:], req.output_top_logprobs[-count:]
        computed = req.kv_len
        for j, token in enumerate(new):
            req.output_ids.append(token)
            if logprobs is not None:
                req.output_logprobs.append(logprobs[j])
                req.output_top_logprobs.append(tops[j])
            req.kv_len = min(computed, req.fill_len)  # what is cached at a finish is the kept tokens' KV only
            if self._take(req, token):
                return True
        return False

    def check_stop(self, req: Req, new_tokens: list[int]) -> bool:
        """Stream the new tokens' text and finish the request if it is done. True when it finished."""
        p = req.params
        token = new_tokens[-1]
        n = len(req.output_ids)
        reason = None
        may_stop = n >= p.min_new_tokens
        if may_stop and not p.ignore_eos and token in self.eos_ids:
            reason = {"type": "stop", "matched": token}
        elif may_stop and token in p.stop_token_ids:
            reason = {"type": "stop", "matched": token}
        t0 = time.perf_counter()
        safe, matched = req.stops.feed(req.decoder.push(new_tokens)) if req.decoder is not None else ("", None)
        self.detokenize_seconds += time.perf_counter() - t0
        req.text += safe
        if matched is not None and may_stop and reason is None:
            reason = {"type": "stop", "matched": matched}
        if reason is None and req.grammar is not None and req.grammar.is_finished(req.fsm_state):
            reason = {"type": "stop", "matched": None}  # the grammar is complete: only EOS could follow
        if reason is None and n >= p.max_new_tokens:
            reason = {"type": "length", "length": p.max_new_tokens}
        if reason is None:
            if req.sink is not None and safe:
                req.sink(req, safe, False)
            return False
        if matched is None and req.decoder is not None:
            tail, matched_late = req.stops.feed(req.decoder.flush())
            req.text += tail + ("" if matched_late is not None else req.stops.finish())
        if req.forced_pending:  # forced tokens still to run as an extend (sampling nothing): their logprobs, then
            req.finish_after_fill = reason  # the finish (on_token); the request stays scheduled until then
            return False
        self.finish(req, reason, release=req in self.scheduler.running)
        return True

    def jump(self, req: Req) -> bool:
        """Jump-forward: append the grammar's forced tokens in one extend instead of decoding them one per step.
        The canonical forced-token rule (docs/fsm.md) makes the tokens exactly those decoding would produce, so
        the output is the same with the switch on or off. True when the request finished."""
        if not self.jump_forward:
            return False
        jump = req.grammar.jump(req.fsm_state)
        if jump is None:
            return False
        tokens = list(jump.tokens[: req.params.max_new_tokens - len(req.output_ids)])
        if not tokens:
            return False
        state = jump.state if len(tokens) == len(jump.tokens) else req.grammar.walk(tokens, req.fsm_state)
        req.output_ids.extend(tokens)
        if req.return_logprob:  # their logprobs come from the extend's rows (scheduler._output_rows)
            req.output_logprobs.extend((None, t) for t in tokens)
            req.output_top_logprobs.extend(None for _ in tokens)
            req.forced_pending += len(tokens)
        req.fsm_state = state
        req.jump_tokens += len(tokens)
        self.jumped_tokens += len(tokens)
        req.prefill_done = False  # the forced tokens run as an extend; the next token comes from its last row
        return self.check_stop(req, tokens)

    def abort(self, rid: str, reason: dict | None = None) -> Req | None:
        """Take a waiting or running request out of the scheduler (a running one frees its pages unkept) and finish
        it with `reason` (a client abort by default). None when no such request is there."""
        req = self.scheduler.abort(rid)
        if req is not None:
            self.finish(req, reason or abort_reason(), release=False)
        return req

    def abort_all(self, reason: dict | None = None) -> None:
        """`abort` every waiting and running request."""
        for req in self.scheduler.live():
            self.abort(req.rid, reason)

    def finish(self, req: Req, reason: dict, release: bool = True) -> None:
        req.finish_reason = reason
        if release:
            self.scheduler.finish(req)
        if self.on_finish is not None:
            self.on_finish(req)
        if req.sink is not None:
            req.sink(req, "", True)


def snapshot(req: Req) -> tuple:
    """What a stream chunk needs of the request now, in O(1): its text, list lengths, cached tokens, finish. An
    overlap placeholder (the token of a step still in flight) is never counted: the lists' committed length is
    what the host has read."""
    n = len(req.output_ids)
    while n and req.output_ids[n - 1] < 0:
        n -= 1
    return req.text, n, len(req.output_logprobs) - req.forced_pending, max(req.cached_tokens, 0), req.finish_reason


def result(req: Req, snap: tuple | None = None) -> dict:
    """The request's result as it was at `snap` (a snapshot; None: now, on the loop thread). The lists only grow at
    their ends (an overlap placeholder is replaced past the snapshot's length), so their first n entries can be read
    from another thread."""
    text, n, n_lp, cached, finish = snap or snapshot(req)
    meta = {
        "id": req.rid,
        "prompt_tokens": len(req.input_ids),
        "completion_tokens": n,
        "cached_tokens": cached,
        "finish_reason": finish,
    }
    if req.spec_steps:
        meta["spec_verify_ct"] = req.spec_steps  # SGLang's: steps that verified a draft for this request
    if req.return_logprob:
        meta["input_token_logprobs"] = [(lp, t, None) for lp, t in req.input_logprobs]
        meta["output_token_logprobs"] = [(lp, t, None) for lp, t in req.output_logprobs[:n_lp]]
        if req.top_logprobs_num:
            meta["input_top_logprobs"] = [_tops(x) for x in req.input_top_logprobs]
            # a prefill-only request's look at the next token is its one entry (as upstream SGLang reports it)
            tops = req.output_top_logprobs[: n_lp or (1 if req.params.max_new_tokens == 0 else 0)]
            meta["output_top_logprobs"] = [_tops(x) for x in tops]
    return {"text": text, "output_ids": req.output_ids[:n], "meta_info": meta}


def _tops(entries):
    return None if entries is None else [(lp, t, None) for lp, t in entries]
