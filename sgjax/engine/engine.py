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
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from sgjax.engine import distributed, scoring, sinks
from sgjax.engine import mesh as tp
from sgjax.engine.adapters import LoraControl
from sgjax.engine.args import ServerArgs
from sgjax.engine.disagg import DisaggControl
from sgjax.engine.drafter import draft_layers, load_draft
from sgjax.engine.images import ImageEncoder
from sgjax.engine.inbox import Abort, Add, Call, Stop, drain_failing
from sgjax.engine.loading import (
    VISION,
    apply_process_settings,
    block_dtype,
    check_args,
    load_model_cached,
    pool_pages,
    run_weights,
)
from sgjax.engine.loop import FATAL_GRACE_SECONDS, EngineLoop
from sgjax.engine.outputs import Outputs, abort_reason
from sgjax.engine.plan import Machine, StepPlan, activation_dtype, resolve
from sgjax.engine.request import Req
from sgjax.engine.requests import GenerateCall, RequestBuilder, asks_for_grammar
from sgjax.engine.runner import Runner
from sgjax.engine.scheduler import Scheduler, SchedulerConfig
from sgjax.engine.steplog import StepRecord, StepWatcher
from sgjax.engine.training import WeightsControl
from sgjax.errors import INTERNAL, SHUTDOWN, EngineError
from sgjax.model import chat_templates
from sgjax.model.config import ModelConfig
from sgjax.model.loader import load_config
from sgjax.model.tokenizer import Tokenizer, load_tokenizer
from sgjax.model.weights import Weights, matrices_dtype

log = logging.getLogger("sgjax.engine")
ENGINE_STACK_BYTES = 64 << 20


class Engine(EngineLoop, WeightsControl, LoraControl, DisaggControl):
    def __init__(self, model_path: str | None = None, **kwargs):
        """Load a model (None: the default SmolLM2) and start serving. kwargs: ServerArgs fields."""
        args = ServerArgs.from_kwargs(model_path, kwargs)
        machine = Machine.here()
        dtype = activation_dtype(args, machine.platform)
        check_args(args)
        apply_process_settings(args)  # before loading: casting the weights compiles programs the cache keeps
        mesh = tp.make_mesh(args.tp_size)  # before loading: a tp_size the host cannot give fails at once
        cfg = load_config(args.model_path, dtype, args.load_format)
        plan = resolve(
            args, cfg, machine, block_dtype=block_dtype(args.model_path) if args.load_format == "auto" else None
        )
        cfg, weights = load_model_cached(
            args.model_path, dtype, args.load_format, mesh=mesh if args.tp_size > 1 else None, plan=plan
        )
        tokenizer = None
        if not args.skip_tokenizer_init:
            tokenizer = chat_templates.with_template(
                load_tokenizer(args.tokenizer_path or args.model_path), args.chat_template, cfg.architecture
            )
        self._start(args, plan, cfg, weights, tokenizer, VISION.get((args.model_path, dtype, args.load_format)))

    @classmethod
    def from_weights(cls, cfg: ModelConfig, weights: Weights, tokenizer: Tokenizer | None = None, **kwargs):
        """An engine over weights already in memory (dummy weights for benchmarks, tiny models in tests), in
        cfg.dtype. Without a tokenizer the engine takes input_ids and returns output_ids only (skip_tokenizer_init).
        auto keeps the matrices as given; an explicit weight_dtype casts them."""
        args = ServerArgs.from_kwargs(None, {**kwargs, "skip_tokenizer_init": tokenizer is None})
        plan = resolve(args, cfg, Machine.here(), given=matrices_dtype(weights))
        mesh = tp.make_mesh(args.tp_size) if args.tp_size > 1 else None
        if mesh is not None:
            tp.check_model(cfg, args.tp_size, args.ep_size)
        engine = cls.__new__(cls)
        engine._start(args, plan, cfg, run_weights(cfg, weights, plan, mesh), tokenizer)
        return engine

    def _start(
        self,
        args: ServerArgs,
        plan: StepPlan,
        cfg: ModelConfig,
        weights: Weights,
        tokenizer: Tokenizer | None,
        vision=None,
    ) -> None:
        """`weights` as the plan's step reads them (loading.run_weights)."""
        self.mesh = tp.make_mesh(args.tp_size)
        tp.check_model(cfg, args.tp_size, args.ep_size)
        log.info(plan.line())
        self._fatal_message: str | None = None
        self._fatal_lock = threading.Lock()
        self._in_call: Call | None = None  # the Call the engine thread runs (a readout may hang with a lost host)
        leader, follower = distributed.roles(args, on_lost=self._fatal)  # (None, None) on one host
        # The sharded model's config (KV heads replicated up to tp_size); tp_size 1 keeps the single-device program.
        run_cfg = tp.tp_config(cfg, args.tp_size)
        run_mesh = self.mesh if args.tp_size > 1 else None
        apply_process_settings(args)
        self.args, self.plan, self.model_config, self.tokenizer = args, plan, cfg, tokenizer
        self.context_length = min(args.context_length or cfg.max_position_embeddings, cfg.max_position_embeddings)
        # STANDALONE's draft model: loaded before the pool is sized, which then holds its KV too
        draft = load_draft(args, cfg) if (args.speculative_algorithm or "").upper() == "STANDALONE" else None
        num_pages = 1 + pool_pages(args, run_cfg, plan.kv_dtype, None if draft is None else draft[0])
        if args.nnodes > 1:  # rank 0's pool size everywhere (free memory may differ between hosts)
            num_pages = distributed.agree(num_pages, leader is not None)
        self.scheduler = Scheduler(SchedulerConfig.from_args(args, num_pages))
        self.max_total_tokens = (num_pages - 1) * args.page_size
        self.runner = Runner(
            run_cfg,
            weights,
            plan,
            num_pages=num_pages,
            page_size=args.page_size,
            max_context=self.context_length,
            max_top_logprobs=args.max_top_logprobs_num,
            max_reqs=args.max_running_requests,
            mesh=run_mesh,
        )
        self.runner.leader = leader
        self._follower = follower
        self._start_lora(args, cfg, run_cfg, self.runner._to_device)
        self._start_disagg(args)
        if self.scheduler.cfg.model_drafts:  # SELF / STANDALONE: a model drafts on the device
            k = self.scheduler.cfg.num_draft_tokens - 1
            self.runner.enable_drafts(k, None if draft else draft_layers(args, cfg), draft)
            self.scheduler.drafter = self.runner.draft
        self.eos_ids = frozenset(tokenizer.eos_token_ids) if tokenizer is not None else frozenset()
        self.images = None if vision is None else ImageEncoder(*vision)  # a vision-language model (LLaVA)
        self.requests = RequestBuilder(
            cfg,
            tokenizer,
            self.images,
            context_length=self.context_length,
            max_total_tokens=self.max_total_tokens,
            max_top_logprobs=args.max_top_logprobs_num,
            eos_ids=self.eos_ids,
            seed=args.random_seed,
            grammar_cache_size=args.grammar_cache_size,
            grammar_compile_timeout=args.grammar_compile_timeout,
            grammars_on=args.grammar_backend != "none",
            max_grammar_chars=args.max_grammar_chars,
            max_images=args.max_images_per_request,
            adapters=self.adapters,
        )
        self.outputs = Outputs(
            self.scheduler,
            tokenizer,
            self.eos_ids,
            jump_forward=not args.disable_jump_forward,
            on_finish=self._finished,
        )
        self._overlapped_steps = 0
        self._grammar_workers = ThreadPoolExecutor(2, thread_name_prefix="sgjax-grammar")
        self.on_step = None  # called on the engine thread with each step's seconds (the server's histogram)
        # Benchmarks set a list here to get every request the engine was given, with its output once finished
        # (for the Theorem 3.1 optimum).
        self.request_log: list[Req] | None = None
        # Benchmarks set a list here to get a StepRecord per step (steplog.py: device busy and idle time).
        self.step_log: list[StepRecord] | None = None
        self._watcher: StepWatcher | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._queue = sinks.Queue(add=lambda req: self._inbox.put(Add(req)), abort=self.abort)
        self._step_seconds = 0.0
        self._closed = False
        self._paused = False  # pause_generation (engine/training.py): the loop runs no step
        self.weights_version = "default"
        self._preparing = 0  # async_generate calls being tokenized (read by queued_requests, event-loop thread)
        if args.precompile if args.precompile is not None else plan.platform != "cpu":
            # a follower compiles the same shapes and runs rank 0's broadcast warm-up steps in `follow`
            log.info(
                self.runner.precompile_start(
                    args.chunked_prefill_size + args.max_running_requests, warm=follower is None
                )
            )
        if follower is not None:  # a follower runs no loop thread: `follow` executes rank 0's steps
            return
        self._thread = threading.Thread(target=self._loop, name="sgjax-engine", daemon=True)
        # XLA compiles new step shapes on this thread: the main thread's stack size, not a small default
        previous = threading.stack_size(ENGINE_STACK_BYTES)
        try:
            self._thread.start()
        finally:
            threading.stack_size(previous)

    # -- multi-host ------------------------------------------------------------------------------------
    def follow(self) -> int:
        """A follower rank (node_rank > 0): run rank 0's steps until it stops; returns the steps run."""
        return self._follower.follow(self.runner)

    def _fatal(self, message: str, status: int = 1) -> None:
        """A follower is lost (called on its watcher's thread; the engine thread may be stuck in a collective
        with it): fail every request with `message` (a 500), refuse new ones, and end the process with `status`
        after a moment for the HTTP responses to go out."""
        with self._fatal_lock:
            if self._fatal_message is not None:
                return
            self._fatal_message = message
        self._closed = True
        try:
            reqs = self.scheduler.live() + drain_failing(self._inbox, message)
            for req in reqs:
                if not req.finished:
                    self.outputs.finish(req, abort_reason(message, INTERNAL), release=False)
            call = self._in_call
            if call is not None:
                call.box["error"] = EngineError(message, INTERNAL)
                call.done.set()
        except Exception:  # noqa: BLE001 - the process ends either way
            log.exception("failing the requests after: %s", message)
        threading.Timer(FATAL_GRACE_SECONDS, os._exit, args=(status,)).start()

    # -- public API -------------------------------------------------------------------------------------
    def generate(
        self,
        prompt=None,
        sampling_params=None,
        input_ids=None,
        return_logprob=False,
        logprob_start_len=None,
        top_logprobs_num=None,
        stream=False,
        rid=None,
        image_data=None,
        lora_path=None,
    ):
        """One prompt -> one result dict (a list when n > 1); a list of prompts -> a list of results.
        stream=True returns an iterator of result dicts whose `text` grows (one prompt, n == 1).
        image_data (vision-language models): base64 images of a prompt, one image token each in the prompt
        (a list per prompt for a batch). lora_path: the name of a loaded LoRA adapter (or one per prompt; None:
        the base model)."""
        return self.run(
            GenerateCall(
                prompt,
                sampling_params,
                input_ids,
                return_logprob,
                logprob_start_len,
                top_logprobs_num,
                stream,
                rid,
                image_data,
                lora_path,
            )
        )

    def run(self, call: GenerateCall):
        """`generate` for a call already built (engine/requests.GenerateCall)."""
        reqs, single = self._make_requests(call)
        if call.stream:
            return sinks.stream(self._queue, reqs[0])
        waits = [sinks.submit(self._queue, r) for r in reqs]
        results = [w() for w in waits]
        return results[0] if single and len(results) == 1 else results

    async def async_generate(
        self,
        prompt=None,
        sampling_params=None,
        input_ids=None,
        return_logprob=False,
        logprob_start_len=None,
        top_logprobs_num=None,
        stream=False,
        rid=None,
        image_data=None,
        lora_path=None,
    ):
        return await self.async_run(
            GenerateCall(
                prompt,
                sampling_params,
                input_ids,
                return_logprob,
                logprob_start_len,
                top_logprobs_num,
                stream,
                rid,
                image_data,
                lora_path,
            )
        )

    async def async_run(self, call: GenerateCall):
        """`async_generate` for a call already built (the HTTP server's)."""
        # Off the caller's event loop: tokenizing is fast, but compiling a new grammar (a JSON schema over a real
        # vocabulary) takes long enough to stall every other request of an HTTP server. Grammar compiles get
        # workers of their own, so that a burst of slow grammars cannot keep plain requests from being tokenized.
        pool = self._grammar_workers if asks_for_grammar(call.sampling_params) else None
        self._preparing += 1  # counted as queued while it is tokenized: a burst cannot all pass the admission check
        try:
            reqs, single = await asyncio.get_running_loop().run_in_executor(pool, self._make_requests, call)
            if call.stream:
                return sinks.async_stream(self._queue, reqs[0])
            waits = [sinks.async_one(self._queue, r) for r in reqs]  # in the inbox before the count drops
        finally:
            self._preparing -= 1
        results = await asyncio.gather(*waits)
        return results[0] if single and len(results) == 1 else list(results)

    def encode(self, prompt=None, input_ids=None) -> list[list[float]]:
        """Embeddings (SGLang's Engine.encode): one unit vector per prompt, the final hidden state of its last token
        (engine/embed.py). Runs between steps on the engine thread; the serving pool is not used."""
        ids = self.requests.whole_prompts(prompt, input_ids)
        return [v.tolist() for v in self._call(lambda: self._readout("embedding", ids))]

    def score(
        self,
        query=None,
        items=None,
        label_token_ids=None,
        apply_softmax: bool = False,
        item_first: bool = False,
        temperature: float = 1.0,
        detail: bool = False,
    ):
        """SGLang's Engine.score: scores[i][j], the probability of label j as the next token after query + item i
        (engine/scoring.py), from the same scratch prefill as encode. detail: a Scores with the log-probabilities."""
        out = scoring.score(
            self.requests,
            lambda ids: self._call(lambda: self._readout("logprobs", ids)),
            query,
            items,
            label_token_ids,
            apply_softmax,
            item_first,
            temperature,
        )
        return out if detail else out.scores

    def _readout(self, kind: str, ids: list[list[int]]):
        """On the engine thread, between steps: across hosts the followers meet it in the same order as the steps
        (the runner broadcasts it)."""
        try:
            return self.runner.readout(kind, ids)
        except Exception as e:
            if self.runner.leader is not None:  # as after a failed step: the ranks may be out of step now
                time.sleep(FATAL_GRACE_SECONDS)  # the watcher names a lost follower first, if one is
                self._fatal(f"a readout across hosts failed: {type(e).__name__}: {e}")
            raise

    @property
    def alive(self) -> bool:
        """The loop thread runs and shutdown has not been asked for (the server's /health)."""
        return not self._closed and self._thread.is_alive()

    def abort(self, rid: str) -> None:
        self._inbox.put(Abort(rid))

    def queued_requests(self) -> int:
        """Requests waiting for the running batch, messages not yet read, and calls still being tokenized (from any
        thread; a snapshot). A stream joins the inbox when first iterated: it is not counted in between."""
        return len(self.scheduler.waiting) + self._inbox.qsize() + self._preparing

    def abort_all(self) -> None:
        """Abort every waiting and running request (SGLang's abort_all)."""
        self._inbox.put(Abort(None))

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
            self._inbox.put(Stop())
            self._thread.join()
            if self.runner.leader is not None:  # after the loop: no step is in flight on any rank
                self.runner.leader.stop()
            self.runner.release()
            self._stop_disagg()
            self._grammar_workers.shutdown(wait=False, cancel_futures=True)
            if self._watcher is not None:
                self._watcher.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    # -- requests ---------------------------------------------------------------------------------------
    def _make_requests(self, call: GenerateCall) -> tuple[list[Req], bool]:
        self._refuse_if_closed()
        reqs, single = self.requests.build(call)
        if call.bootstrap is not None and self.disagg_mode != "null":
            self._disaggregate(reqs)
        if self.request_log is not None:
            self.request_log.extend(reqs)
        return reqs, single

    def _finished(self, req: Req) -> None:
        """Every finished request, on the engine thread: its id may be used again; a prefill worker's request
        leaves its prompt's pages for the decode worker (engine/disagg.py)."""
        self.requests.forget(req)
        if req.export_room is not None:
            self._export_pages(req, aborted=req.finish_reason.get("type") == "abort")

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise EngineError(
                self._fatal_message or "the engine is shut down", INTERNAL if self._fatal_message else SHUTDOWN
            )

    # -- the engine thread (engine/loop.py runs it) -------------------------------------------------
    def _call(self, fn):
        """Run `fn` on the engine thread between steps and return its result."""
        self._refuse_if_closed()
        done, box = threading.Event(), {}
        self._inbox.put(Call(fn, done, box))
        done.wait()
        if "error" in box:
            raise box["error"]
        return box["result"]

    def _server_info(self) -> dict:
        return {
            "model_path": self.args.model_path,
            "page_size": self.args.page_size,
            "max_total_tokens": self.max_total_tokens,
            "context_length": self.context_length,
            **self.runner.report(),
            **self.scheduler.report(),
            **({} if self.adapters is None else self.adapters.report()),
            **self._disagg_report(),
            "step_seconds": self._step_seconds,
            "detokenize_seconds": self.outputs.detokenize_seconds,
            "jump_forward_tokens": self.outputs.jumped_tokens,
            "overlapped_steps": self._overlapped_steps,
            "generated_tokens": self.outputs.sampled_tokens + self.outputs.jumped_tokens,
            "grammar_cache": dataclasses.asdict(self.requests.grammars.stats),
        }
