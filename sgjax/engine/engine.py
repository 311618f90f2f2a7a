"""`sgjax.Engine`: SGLang's offline engine API over the scheduler and runner.

The engine owns one background thread that runs the loop: take new requests and aborts from an inbox, schedule a
step, run it, commit the results, then do the host work per new token (stop checks, detokenization, streaming).
Callers' threads only validate, tokenize and enqueue, so `generate` can be called from many threads, from asyncio
(`async_generate`) and by the HTTP server at once. A failure inside a step fails the requests of that step with an
error message and returns their pages; the loop keeps serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import queue
import sys
import threading
import time
import uuid

import jax
import numpy as np

from sgjax.engine.args import ServerArgs
from sgjax.engine.detokenize import IncrementalDecoder, StopMatcher
from sgjax.engine.images import ImageEncoder
from sgjax.engine.loading import VISION, default_dtype, load_model_cached, pool_pages
from sgjax.engine.params import SamplingParams, SamplingParamsError
from sgjax.engine.request import Req
from sgjax.engine.runner import Runner
from sgjax.engine.scheduler import Scheduler, SchedulerConfig
from sgjax.engine.steplog import StepRecord, StepWatcher, record_of
from sgjax.fsm import GrammarCache, GrammarError, RegexError, from_tokenizer
from sgjax.kernels import default_backend
from sgjax.model.config import ModelConfig
from sgjax.model.tokenizer import Tokenizer, load_tokenizer
from sgjax.model.weights import Weights

log = logging.getLogger("sgjax.engine")


class EngineError(RuntimeError):
    pass


class Engine:
    def __init__(self, model_path: str | None = None, **kwargs):
        """Load a model (None: the default SmolLM2) and start serving. kwargs: ServerArgs fields."""
        args = ServerArgs.from_kwargs(model_path, kwargs)
        if args.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {args.load_format!r}")
        cfg, weights = load_model_cached(args.model_path, default_dtype(args), args.load_format)
        tokenizer = None if args.skip_tokenizer_init else load_tokenizer(args.model_path)
        self._start(args, cfg, weights, tokenizer, VISION.get((args.model_path, default_dtype(args), args.load_format)))

    @classmethod
    def from_weights(cls, cfg: ModelConfig, weights: Weights, tokenizer: Tokenizer | None = None, **kwargs):
        """An engine over weights already in memory (dummy weights for benchmarks, tiny models in tests).
        Without a tokenizer the engine takes input_ids and returns output_ids only (skip_tokenizer_init)."""
        args = ServerArgs.from_kwargs(None, {**kwargs, "skip_tokenizer_init": tokenizer is None})
        engine = cls.__new__(cls)
        engine._start(args, cfg, weights, tokenizer)
        return engine

    def _start(self, args: ServerArgs, cfg: ModelConfig, weights: Weights, tokenizer: Tokenizer | None,
               vision=None) -> None:
        platform = jax.devices()[0].platform
        if args.step_buckets not in (None, "fine", "coarse"):
            raise ValueError(f"step_buckets must be 'fine' or 'coarse', got {args.step_buckets!r}")
        if args.gil_switch_interval_ms is not None:
            if not args.gil_switch_interval_ms > 0:
                raise ValueError(f"gil_switch_interval_ms must be positive or None, got {args.gil_switch_interval_ms}")
            sys.setswitchinterval(args.gil_switch_interval_ms / 1e3)
        if args.compilation_cache_dir and not jax.config.jax_compilation_cache_dir:
            jax.config.update("jax_compilation_cache_dir", os.path.expanduser(args.compilation_cache_dir))
        self.args, self.model_config, self.tokenizer = args, cfg, tokenizer
        self.context_length = min(args.context_length or cfg.max_position_embeddings, cfg.max_position_embeddings)
        num_pages = 1 + pool_pages(args, cfg, platform)
        self.scheduler = Scheduler(SchedulerConfig(
            num_pages=num_pages, page_size=args.page_size, policy=args.schedule_policy,
            cache="none" if args.disable_radix_cache else args.cache,
            chunked_prefill_size=args.chunked_prefill_size, max_running_requests=args.max_running_requests,
            init_new_token_ratio=0.7 * args.schedule_conservativeness,
            min_new_token_ratio=0.1 * args.schedule_conservativeness, seed=args.random_seed))
        self.max_total_tokens = (num_pages - 1) * args.page_size
        self.runner = Runner(cfg, weights, num_pages=num_pages, page_size=args.page_size,
                             max_context=self.context_length,
                             attention=args.attention_backend or default_backend(platform),
                             max_top_logprobs=args.max_top_logprobs_num,
                             coarse=None if args.step_buckets is None else args.step_buckets == "coarse",
                             max_reqs=args.max_running_requests)
        self.eos_ids = frozenset(tokenizer.eos_token_ids) if tokenizer is not None else frozenset()
        self.images = None if vision is None else ImageEncoder(*vision)  # a vision-language model (LLaVA)
        self._seeds = np.random.default_rng(args.random_seed)
        self._grammars = GrammarCache(max_entries=args.grammar_cache_size)
        self._vocabulary = None
        self._jumped_tokens = 0
        self._overlapped_steps = 0
        self._sampled_tokens = 0
        self.on_step = None  # called on the engine thread with each step's seconds (the server's histogram)
        # Benchmarks set a list here to get every request the engine was given, with its output once finished
        # (for the Theorem 3.1 optimum).
        self.request_log: list[Req] | None = None
        # Benchmarks set a list here to get a StepRecord per step (steplog.py: device busy and idle time).
        self.step_log: list[StepRecord] | None = None
        self._watcher: StepWatcher | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._step_seconds = 0.0
        self._detokenize_seconds = 0.0
        self._closed = False
        if args.precompile if args.precompile is not None else platform != "cpu":
            self._precompile()
        self._thread = threading.Thread(target=self._loop, name="sgjax-engine", daemon=True)
        self._thread.start()

    # -- public API -------------------------------------------------------------------------------------
    def generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                 logprob_start_len=None, top_logprobs_num=None, stream=False, rid=None, image_data=None):
        """One prompt -> one result dict (a list when n > 1); a list of prompts -> a list of results.
        stream=True returns an iterator of result dicts whose `text` grows (one prompt, n == 1).
        image_data (vision-language models): base64 images of a prompt, one image token each in the prompt
        (a list per prompt for a batch)."""
        reqs, single = self._make_requests(prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                                           top_logprobs_num, rid, stream, image_data)
        if stream:
            return self._stream(reqs[0])
        waits = [self._submit(r) for r in reqs]
        results = [w() for w in waits]
        return results[0] if single and len(results) == 1 else results

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                             logprob_start_len=None, top_logprobs_num=None, stream=False, rid=None, image_data=None):
        # Off the caller's event loop: tokenizing is fast, but compiling a new grammar takes 50-250 ms (JSON schema
        # on SmolLM2's vocabulary), which would stall every other request of an HTTP server.
        reqs, single = await asyncio.to_thread(self._make_requests, prompt, sampling_params, input_ids,
                                               return_logprob, logprob_start_len, top_logprobs_num, rid, stream,
                                               image_data)
        if stream:
            return self._async_stream(reqs[0])
        results = await asyncio.gather(*(self._async_one(r) for r in reqs))
        return results[0] if single and len(results) == 1 else list(results)

    @property
    def alive(self) -> bool:
        """The loop thread runs and shutdown has not been asked for (the server's /health)."""
        return not self._closed and self._thread.is_alive()

    def abort(self, rid: str) -> None:
        self._inbox.put(("abort", rid))

    def flush_cache(self) -> bool:
        return self._call(self.scheduler.flush_cache)

    def get_server_info(self) -> dict:
        return self._call(self._server_info)

    def check_invariants(self) -> None:
        """The cache's page accounting, checked on the engine thread between steps (tests, debugging)."""
        self._call(self.scheduler.check_invariants)

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self._inbox.put(("stop", None))
            self._thread.join()
            self.runner.pool = None
            if self._watcher is not None:
                self._watcher.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    # -- requests ---------------------------------------------------------------------------------------
    def _make_requests(self, prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                       top_logprobs_num, rid, stream=False, image_data=None):
        if self._closed:
            raise EngineError("the engine is shut down")
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt or input_ids")
        single = isinstance(prompt, str) if prompt is not None else not (input_ids and isinstance(input_ids[0], list))
        prompts = ([prompt] if single else list(prompt)) if prompt is not None else None
        ids_list = ([input_ids] if single else list(input_ids)) if input_ids is not None else None
        count = len(prompts if prompts is not None else ids_list)
        params_list = sampling_params if isinstance(sampling_params, list) else [sampling_params] * count
        if len(params_list) != count:
            raise ValueError(f"{count} prompts but {len(params_list)} sampling_params")
        rids = rid if isinstance(rid, list) else [rid] * count
        if image_data is not None:
            if self.images is None:
                raise ValueError("image_data: this engine's model is text-only (load a LLaVA checkpoint directory "
                                 "for images)")
            images_list = [image_data] if single else list(image_data)
            if len(images_list) != count:
                raise ValueError(f"image_data: {count} prompts but {len(images_list)} image lists")
        reqs = []
        for i in range(count):
            params = SamplingParams.from_dict(params_list[i])
            params.validate(self.model_config.vocab_size)
            if params.stop and self.tokenizer is None:
                raise ValueError("stop strings need a tokenizer; this engine has none (use stop_token_ids)")
            ids = self._tokens(prompts[i] if prompts is not None else None, ids_list[i] if ids_list else None)
            images = None
            if image_data is not None and images_list[i] is not None:
                ids, images = self.images.prepare(ids, images_list[i], self.model_config.vocab_size,
                                                  None if single else i)
            params = self._fit_length(params, ids)
            grammar = self._grammar(params)
            lp_start = self._check_logprob_args(return_logprob, logprob_start_len, top_logprobs_num, ids)
            base = rids[i] or uuid.uuid4().hex
            for j in range(params.n):
                seed = (params.seed32 + j) % (2 ** 31) if params.seed is not None else int(self._seeds.integers(2 ** 31))
                reqs.append(Req(rid=base if params.n == 1 else f"{base}-{j}", input_ids=list(ids), params=params,
                                seed=seed, return_logprob=bool(return_logprob), logprob_start_len=lp_start,
                                top_logprobs_num=int(top_logprobs_num or 0), grammar=grammar, images=images,
                                min_tokens_stops=self._min_tokens_stops(params)))
        if stream and len(reqs) != 1:
            raise ValueError("stream=True takes one prompt with n == 1")
        if self.request_log is not None:
            self.request_log.extend(reqs)
        return reqs, single

    def _grammar(self, params: SamplingParams):
        """The compiled FSM of a regex / json_schema request (cached across requests), or None."""
        if params.regex is None and params.json_schema is None:
            return None
        if self.tokenizer is None:
            raise ValueError("regex and json_schema need a tokenizer; this engine has none")
        if self._vocabulary is None:
            self._vocabulary = from_tokenizer(self.tokenizer)
        try:
            if params.regex is not None:
                return self._grammars.get_regex(params.regex, self._vocabulary)
            return self._grammars.get_json_schema(params.json_schema, self._vocabulary)
        except (GrammarError, RegexError) as e:
            field_name = "regex" if params.regex is not None else "json_schema"
            raise SamplingParamsError(f"{field_name}: {e}") from None
        except (TypeError, ValueError, AttributeError, KeyError) as e:
            # An ill-typed keyword ({"anyOf": 3}, "maxLength": "x") trips the schema compiler before its own checks:
            # still the request's mistake, not the engine's.
            raise SamplingParamsError(f"json_schema: invalid schema ({type(e).__name__}: {e})") from None

    def _tokens(self, text, ids) -> list[int]:
        if text is not None:
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer (skip_tokenizer_init): pass input_ids")
            if not isinstance(text, str):
                raise ValueError(f"prompt must be a string, got {type(text).__name__}")
            ids = self.tokenizer.encode(text)
        ids = [int(t) for t in ids]
        if not ids:
            raise ValueError("the prompt is empty (0 tokens)")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"input_ids has token ids outside [0, {vocab}): {bad[:5]}")
        return ids

    def _fit_length(self, params: SamplingParams, ids: list[int]) -> SamplingParams:
        """Reject prompts that cannot fit; shorten max_new_tokens to the context and the pool, as SGLang does."""
        limit = min(self.context_length, self.max_total_tokens)
        if len(ids) >= limit:
            raise ValueError(f"the prompt has {len(ids)} tokens; this engine takes at most {limit - 1} "
                             f"(context_length {self.context_length}, max_total_tokens {self.max_total_tokens})")
        if len(ids) + params.max_new_tokens > limit:
            return dataclasses.replace(params, max_new_tokens=limit - len(ids))
        return params

    def _check_logprob_args(self, return_logprob, start, top, ids) -> int:
        if top is not None and (not isinstance(top, int) or top < 0 or top > self.args.max_top_logprobs_num):
            raise ValueError(f"top_logprobs_num must be an int in [0, {self.args.max_top_logprobs_num}], got {top!r}")
        if start is None or not return_logprob:
            return -1
        if not isinstance(start, int) or start < -1 or start >= len(ids):
            raise ValueError(f"logprob_start_len must be -1 or in [0, {len(ids)}) for this prompt, got {start!r}")
        return start

    def _submit(self, req: Req):
        done = threading.Event()
        box = {}

        def sink(req, new_text, finished):
            if finished:
                box["result"] = self._result(req)
                done.set()

        req.sink = sink
        self._inbox.put(("add", req))

        def wait():
            done.wait()
            return box["result"]

        return wait

    def _stream(self, req: Req):
        chunks: queue.Queue = queue.Queue()
        # The loop thread only takes a snapshot (O(1)); the caller's thread copies the lists (O(n) per chunk).
        req.sink = lambda r, new_text, finished: chunks.put(_snapshot(r))
        self._inbox.put(("add", req))
        try:
            while True:
                item = self._result(req, chunks.get())
                yield item
                if item["meta_info"]["finish_reason"] is not None:
                    return
        finally:
            if not req.finished:
                self.abort(req.rid)

    async def _async_one(self, req: Req):
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def sink(r, new_text, finished):
            if finished:
                result = self._result(r)
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(result))

        req.sink = sink
        self._inbox.put(("add", req))
        try:
            return await fut
        except asyncio.CancelledError:
            self.abort(req.rid)
            raise

    async def _async_stream(self, req: Req):
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue = asyncio.Queue()
        req.sink = lambda r, new_text, finished: loop.call_soon_threadsafe(chunks.put_nowait, _snapshot(r))
        self._inbox.put(("add", req))
        try:
            while True:
                item = self._result(req, await chunks.get())
                yield item
                if item["meta_info"]["finish_reason"] is not None:
                    return
        finally:
            if not req.finished:
                self.abort(req.rid)

    def _result(self, req: Req, snap: tuple | None = None) -> dict:
        """The request's result as it was at `snap` (a _snapshot; None: now, on the loop thread). The lists only
        grow at their ends (an overlap placeholder is replaced past the snapshot's length), so their first n
        entries can be read from another thread."""
        text, n, n_lp, cached, finish = snap or _snapshot(req)
        meta = {"id": req.rid, "prompt_tokens": len(req.input_ids), "completion_tokens": n,
                "cached_tokens": cached, "finish_reason": finish}
        if req.return_logprob:
            meta["input_token_logprobs"] = [(lp, t, None) for lp, t in req.input_logprobs]
            meta["output_token_logprobs"] = [(lp, t, None) for lp, t in req.output_logprobs[:n_lp]]
            if req.top_logprobs_num:
                meta["input_top_logprobs"] = [_tops(x) for x in req.input_top_logprobs]
                meta["output_top_logprobs"] = [_tops(x) for x in req.output_top_logprobs[:n_lp]]
        return {"text": text, "output_ids": req.output_ids[:n], "meta_info": meta}

    # -- the loop ---------------------------------------------------------------------------------------
    def _call(self, fn):
        """Run `fn` on the engine thread between steps and return its result."""
        if self._closed:
            raise EngineError("the engine is shut down")
        done, box = threading.Event(), {}
        self._inbox.put(("call", (fn, done, box)))
        done.wait()
        if "error" in box:
            raise box["error"]
        return box["result"]

    def _loop(self) -> None:
        """Schedule, dispatch, commit. With overlap, a decode step's commit waits for the next step's dispatch:
        (a) schedule k on the provisional state of k-1, (b) dispatch k, (c) commit k-1 for real (tokens, stops,
        streams, finishes), (d) commit k ahead (placeholders) when it can overlap, else wait for it now."""
        sched = self.scheduler
        ahead = None  # (works, handle, t0) of a dispatched step committed ahead, not yet for real
        while True:
            try:
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
                        handle = (works, self.runner.dispatch(works), t0)
                    if self.step_log is not None:
                        record = self._log_step(works, handle, t0)
                if ahead is not None:
                    self._commit(*ahead)
                    ahead = None
                if handle is None:
                    # nothing fits even with no request running: cannot happen for validated requests; never spin
                    # (after a step in flight the pages it freed were not free yet when this round scheduled)
                    if not had_ahead and sched.waiting and not sched.running:
                        req = sched.waiting.pop(0)
                        self._finish(req, {"type": "abort", "message": "the request does not fit"}, release=False)
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
                ahead = None
                for req in list(sched.running):
                    sched.abort(req.rid)
                    self._finish(req, {"type": "abort", "message": f"internal error: {e}"}, release=False)
                if self.runner.pool_lost():  # the donated pool died with the step: its KV is gone
                    self.runner.reset_pool()
                    sched.cache.reset()

    def _overlaps(self, works) -> bool:
        """Whether the next step may read this step's tokens on the device: every row decodes a request whose
        next step needs nothing from the host (no FSM state: its mask needs the real token). A penalty window reads
        the in-flight token from the device like the input does."""
        if self.args.disable_overlap_schedule:
            return False
        for w in works:
            req = w.req
            if not (w.sample and len(w.tokens) == 1 and req.prefill_done and req.grammar is None):
                return False
        return True

    def _commit(self, works, handle, t0) -> None:
        with jax.profiler.TraceAnnotation("sgjax.collect"):
            tokens, logprobs, top = self.runner.collect(works, handle)
        dt = time.perf_counter() - t0
        self._step_seconds += dt
        if self.on_step is not None:
            self.on_step(dt)
        with jax.profiler.TraceAnnotation("sgjax.commit"):
            for req in self.scheduler.commit(works, tokens, logprobs, top):
                self._after_token(req)

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
                kind, item = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if kind == "stop":
                for req in list(self.scheduler.waiting) + list(self.scheduler.running):
                    self.scheduler.abort(req.rid)
                    self._finish(req, {"type": "abort", "message": "engine shut down"}, release=False)
                return False
            if kind == "add":
                if self.tokenizer is not None:
                    item.decoder = IncrementalDecoder(self.tokenizer, item.params.skip_special_tokens)
                item.stops = StopMatcher(item.params.stop, item.params.no_stop_trim)
                if item.grammar is not None and self._jump(item):  # forced text before the first token
                    continue
                self.scheduler.add(item)
            elif kind == "abort":
                req = self.scheduler.abort(item)
                if req is not None:
                    self._finish(req, {"type": "abort"}, release=False)
            elif kind == "call":
                fn, done, box = item
                try:
                    box["result"] = fn()
                except Exception as e:  # returned to the caller's thread
                    box["error"] = e
                done.set()

    def _after_token(self, req: Req) -> None:
        """Stop checks, the FSM and streaming for a request that got a token (or finished a prefill-only run)."""
        if req.params.max_new_tokens == 0:
            self._finish(req, {"type": "length", "length": 0})
            return
        self._sampled_tokens += 1
        token = req.output_ids[-1]
        if req.grammar is not None:
            req.fsm_state = req.grammar.next_state(req.fsm_state, token)
            if req.fsm_state < 0:  # the mask forbade it: only an all-masked row (a broken grammar) gets here
                self._finish(req, {"type": "abort", "message": f"token {token} violates the grammar"})
                return
        if self._check_stop(req, [token]):
            return
        if req.grammar is not None:
            self._jump(req)

    def _min_tokens_stops(self, p: SamplingParams) -> tuple:
        """What the sampler masks while a request is short of min_new_tokens: the tokens that would stop it."""
        if not p.min_new_tokens:
            return ()
        return tuple(sorted((set() if p.ignore_eos else set(self.eos_ids)) | set(p.stop_token_ids)))

    def _check_stop(self, req: Req, new_tokens: list[int]) -> bool:
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
        self._detokenize_seconds += time.perf_counter() - t0  # host time between steps (docs/server.md)
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
        self._finish(req, reason, release=req in self.scheduler.running)
        return True

    def _jump(self, req: Req) -> bool:
        """Jump-forward: append the grammar's forced tokens in one extend instead of decoding them one per step.
        The canonical forced-token rule (docs/fsm.md) makes the tokens exactly those decoding would produce, so
        the output is the same with the switch on or off. True when the request finished."""
        if self.args.disable_jump_forward:
            return False
        jump = req.grammar.jump(req.fsm_state)
        if jump is None:
            return False
        tokens = list(jump.tokens[:req.params.max_new_tokens - len(req.output_ids)])
        if not tokens:
            return False
        state = jump.state if len(tokens) == len(jump.tokens) else req.grammar.walk(tokens, req.fsm_state)
        req.output_ids.extend(tokens)
        if req.return_logprob:  # not computed: these tokens were forced, not sampled
            req.output_logprobs.extend((None, t) for t in tokens)
            req.output_top_logprobs.extend(None for _ in tokens)
        req.fsm_state = state
        req.jump_tokens += len(tokens)
        self._jumped_tokens += len(tokens)
        req.prefill_done = False  # the forced tokens run as an extend; the next token comes from its last row
        return self._check_stop(req, tokens)

    def _finish(self, req: Req, reason: dict, release: bool = True) -> None:
        req.finish_reason = reason
        if release:
            self.scheduler.finish(req)
        if req.sink is not None:
            req.sink(req, "", True)

    def _precompile(self) -> None:
        """The step shapes most traffic takes (Runner.start_shapes), at the widest page table, compiled and run
        once. A step holds at most a prefill chunk plus one decode row per running request."""
        t0 = time.perf_counter()
        shapes = self.runner.start_shapes(self.args.chunked_prefill_size + self.args.max_running_requests)
        threads = 1 if self.runner.platform == "cpu" else max(1, min(len(shapes), (os.cpu_count() or 2) // 2))
        self.runner.precompile(shapes, threads)
        t1 = time.perf_counter()
        self.runner.warm(shapes)
        log.info("precompiled %d step shapes in %.1f s (%d threads), ran each once in %.1f s", len(shapes),
                 t1 - t0, threads, time.perf_counter() - t1)

    def _server_info(self) -> dict:
        s, a, c = self.scheduler, self.scheduler.allocator, self.scheduler.cache
        st = s.stats
        return {
            "model_path": self.args.model_path, "page_size": self.args.page_size,
            "max_total_tokens": self.max_total_tokens, "context_length": self.context_length,
            "schedule_policy": s.cfg.policy, "cache": s.cfg.cache, "attention_backend": self.runner.attention,
            "num_pages": a.capacity, "free_pages": a.num_free, "evictable_pages": c.evictable_pages,
            "protected_pages": c.protected_pages, "pool_usage": 1.0 - a.num_free / a.capacity,
            "running_requests": len(s.running), "waiting_requests": len(s.waiting),
            "prompt_tokens": st.prompt_tokens, "cached_tokens": st.cached_tokens, "cache_hit_rate": s.hit_rate,
            "retractions": st.retractions, "steps": st.steps, "tree_seconds": st.tree_seconds,
            "admit_seconds": st.admit_seconds,
            "step_seconds": self._step_seconds, "detokenize_seconds": self._detokenize_seconds,
            "compiled_shapes": len(self.runner.shapes_seen),
            "traces": self.runner.traces, "jump_forward_tokens": self._jumped_tokens,
            "overlapped_steps": self._overlapped_steps,
            "generated_tokens": self._sampled_tokens + self._jumped_tokens,
            "grammar_cache": dataclasses.asdict(self._grammars.stats),
        }


def _snapshot(req: Req) -> tuple:
    """What a stream chunk needs of the request now, in O(1): its text, list lengths, cached tokens, finish."""
    return req.text, len(req.output_ids), len(req.output_logprobs), max(req.cached_tokens, 0), req.finish_reason


def _tops(entries):
    return None if entries is None else [(lp, t, None) for lp, t in entries]
