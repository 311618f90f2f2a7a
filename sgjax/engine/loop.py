"""The engine thread's loop (`EngineLoop`, the Engine's base): take new requests and aborts from the inbox, schedule
a step, dispatch it, commit the one before, and hand each new token to the outputs. With overlap, a decode step's
commit waits for the next step's dispatch, so the host's work runs while the device computes.

A failure inside a step fails the requests of that step with an error message and returns their pages; the loop
keeps serving. Across hosts a failed collective is not recoverable: the engine ends the process instead.
"""

from __future__ import annotations

import logging
import queue
import time

import jax

from sgjax.engine.inbox import Abort, Add, Call, Stop
from sgjax.engine.outputs import abort_reason
from sgjax.engine.steplog import StepRecord, StepWatcher, record_of
from sgjax.errors import INTERNAL, SHUTDOWN

log = logging.getLogger("sgjax.engine")

# Multi-host: seconds between failing every request on a lost follower and ending the process (the responses' time)
FATAL_GRACE_SECONDS = 1.0


class EngineLoop:
    """The loop's methods; the state they read (scheduler, runner, outputs, inbox, args, step log) is the Engine's
    (engine/engine.py)."""

    def _loop(self) -> None:
        """Schedule, dispatch, commit. With overlap, a decode step's commit waits for the next step's dispatch:
        (a) schedule k on the provisional state of k-1, (b) dispatch k, (c) commit k-1 for real (tokens, stops,
        streams, finishes), (d) commit k ahead (placeholders) when it can overlap, else wait for it now."""
        sched = self.scheduler
        ahead = None  # (works, handle, t0) of a dispatched step committed ahead, not yet for real
        while True:
            try:
                if self._paused:  # pause_generation: no step runs, and none is in flight for the calls that follow
                    if ahead is not None:
                        self._commit(*ahead)
                        ahead = None
                    if not self._drain(block=True):
                        break
                    continue
                if not self._drain(block=not sched.has_work and ahead is None):
                    break
                had_ahead = ahead is not None
                with jax.profiler.TraceAnnotation("sgjax.schedule"):
                    works = sched.schedule(retract=ahead is None)
                if works is None:  # a retraction must see real tokens: finish the step in flight first
                    self._commit(*ahead)
                    ahead = None
                    with jax.profiler.TraceAnnotation("sgjax.schedule"):
                        works = sched.schedule()
                t0 = time.perf_counter()
                handle = record = None
                if works:
                    with jax.profiler.TraceAnnotation("sgjax.dispatch"):
                        works, handle = self._dispatch(works, t0)
                    if handle is not None and self.step_log is not None:
                        record = self._log_step(works, handle, t0)
                if ahead is not None:
                    self._commit(*ahead)
                    ahead = None
                if handle is None:
                    # nothing fits even with no request running: cannot happen for validated requests; never spin
                    # (after a step in flight the pages it freed were not free yet when this round scheduled)
                    if not had_ahead and sched.waiting and not sched.running:
                        req = sched.waiting.pop(0)
                        self.outputs.finish(req, abort_reason("the request does not fit", INTERNAL), release=False)
                    continue
                if self._overlaps(works):
                    sched.commit_ahead(works)
                    ahead = handle
                    self._overlapped_steps += 1
                    if record is not None:
                        record.overlapped = True
                else:
                    self._commit(*handle)
            except Exception as e:  # a bug or a device error: fail what ran, keep serving
                log.exception("engine step failed")
                if self.runner.leader is not None:  # across hosts a failed collective is not recoverable
                    time.sleep(FATAL_GRACE_SECONDS)  # the watcher names a lost follower first, if one is
                    self._fatal(f"a step across hosts failed: {type(e).__name__}: {e}")
                    return
                ahead = None
                for req in list(sched.running):
                    self.outputs.abort(req.rid, abort_reason(f"internal error: {e}", INTERNAL))
                if self.runner.pool_lost():  # the donated pool died with the step: its KV is gone
                    self.runner.reset_pool()
                    sched.cache.reset()

    def _dispatch(self, works, t0):
        """Dispatch a step. When building it fails, the rows that fail on their own are aborted with the error and
        the step runs for the others (one bad request must not fail its neighbours); a failure no single row
        reproduces is the whole step's (the loop's handler aborts what ran)."""
        try:
            return works, (works, self.runner.dispatch(works), t0)
        except Exception as e:
            bad = [w for w in works if not self.runner.prepares([w])]
            if not bad:
                raise
            log.exception("building a step failed for %d of its %d requests; aborting those", len(bad), len(works))
            for w in bad:
                self.outputs.abort(w.req.rid, abort_reason(f"internal error: {type(e).__name__}: {e}", INTERNAL))
            works = [w for w in works if w not in bad]
            return works, ((works, self.runner.dispatch(works), t0) if works else None)

    def _overlaps(self, works) -> bool:
        """Whether the next step may be scheduled before this one's tokens are read: no row samples for a request
        whose next step needs its token on the host (an FSM state: its mask needs the real token). Prefill and
        extend chunks need nothing from the host; a chunk that completes the fill samples like a decode row, and
        the next step reads that token from the device. A penalty window reads the in-flight token the same way."""
        if self.args.disable_overlap_schedule or self.scheduler.speculating:
            return False  # a draft is made from the last token, so speculative decoding reads each step's tokens
        # a step's drafts are verified on the host even when its admissions took the batch past speculation's size
        return not any(w.draft or (w.sample and w.req.grammar is not None) for w in works)

    def _commit(self, works, handle, t0) -> None:
        with jax.profiler.TraceAnnotation("sgjax.collect"):
            tokens, logprobs, top = self.runner.collect(works, handle)
        dt = time.perf_counter() - t0
        self._step_seconds += dt
        if self.on_step is not None:
            self.on_step(dt)
        with jax.profiler.TraceAnnotation("sgjax.commit"):
            for req in self.scheduler.commit(works, tokens, logprobs, top):
                self.outputs.on_token(req)

    def _log_step(self, works, handle, t0) -> StepRecord:
        record = record_of(works, t0, time.perf_counter())
        if self._watcher is None:
            self._watcher = StepWatcher()
        self._watcher.watch(record, handle[1][0].tokens)
        self.step_log.append(record)
        return record

    def _drain(self, block: bool) -> bool:
        """Handle inbox messages; wait for one when idle. False when asked to stop."""
        while True:
            try:
                msg = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if isinstance(msg, Stop):
                self.outputs.abort_all(abort_reason("engine shut down", SHUTDOWN))
                return False
            if isinstance(msg, Add):
                if not self.outputs.start(msg.req):  # forced text before the first token may finish it
                    self.scheduler.add(msg.req)
            elif isinstance(msg, Abort):
                if msg.rid is None:
                    self.outputs.abort_all()
                else:
                    self.outputs.abort(msg.rid)
            elif isinstance(msg, Call):
                self._in_call = msg
                try:
                    msg.box["result"] = msg.fn()
                except Exception as e:  # returned to the caller's thread
                    msg.box["error"] = e
                finally:
                    self._in_call = None
                msg.done.set()
                if self._paused:  # back to the loop's top, which finishes the step in flight before the next call
                    return True
