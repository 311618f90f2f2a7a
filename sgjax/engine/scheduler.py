"""The scheduler: paper Algorithm 1 over the radix cache, with chunked prefill, retraction and aborts.

Each step it (1) plans the running requests' next tokens (one decode token each, or the next prefill chunk),
retracting running requests while their pages cannot be found, then (2) matches every waiting request against the
cache, orders them by policy and admits them while free + evictable pages cover their prompt plus a reserve for
the tokens the running requests will still generate. Prefill, extend and decode rows go into one ragged batch.

Page ownership: a running request's page table is `tree_pages` pages owned by the cache (protected by its lock on
`last_node`) followed by its own pages. The scheduler gives pages back only through the cache (`insert`, which
takes ownership) or `PageAllocator.free` (the tail page, aborts), so `free + evictable + protected + own == total`
holds between steps (`check_invariants`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from sgjax.cache import POLICIES, PageAllocator, make_cache, schedule_order
from sgjax.cache.base import MatchResult
from sgjax.engine import ngram
from sgjax.engine.request import Req
from sgjax.engine.sentinels import future_input
from sgjax.engine.work import Work

EMPTY = np.zeros(0, np.int32)


@dataclass(frozen=True)
class SchedulerConfig:
    num_pages: int  # pool pages including the null page
    page_size: int = 16
    policy: str = "lpm"
    cache: str = "radix"  # radix | table | none (--disable-radix-cache)
    chunked_prefill_size: int = 512  # tokens per step: prefill chunks plus the decode rows beside them
    max_running_requests: int = 64
    # Admission reserve for tokens the running requests will still generate (SGLang's new_token_ratio): it starts
    # high, decays while nothing is retracted, and jumps back after a retraction.
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.001
    # A waiting request that shares this many uncached tokens with one admitted in the same round waits one
    # round, so that it hits the prefix the other one is about to cache instead of computing it again.
    in_batch_prefix_tokens: int = 32
    max_match_queue: int = 128  # beyond this many waiting requests, match only the oldest (SGLang: FCFS fallback)
    # A waiting request keeps its match between admission rounds until the tree grows under its last node (or loses
    # it); off, every round matches again (the same answers, for benchmarks and tests to compare).
    match_cache: bool = True
    # Speculative decoding (NGRAM): most tokens a decoding row verifies per step (its last token and the drafted
    # ones); 0 or 1: off.
    num_draft_tokens: int = 0
    spec_below_running: int | None = None  # speculate only while fewer requests than this run; None: always
    model_drafts: bool = False  # SELF / STANDALONE: drafts from Scheduler.drafter (the device), not prompt lookup
    seed: int = 0

    @classmethod
    def from_args(cls, args, num_pages: int) -> "SchedulerConfig":
        """The scheduler's settings from the engine's (engine/args.ServerArgs)."""
        return cls(
            num_pages=num_pages,
            page_size=args.page_size,
            policy=args.schedule_policy,
            cache="none" if args.disable_radix_cache else args.cache,
            chunked_prefill_size=args.chunked_prefill_size,
            max_running_requests=args.max_running_requests,
            init_new_token_ratio=0.7 * args.schedule_conservativeness,
            min_new_token_ratio=0.1 * args.schedule_conservativeness,
            seed=args.random_seed,
            num_draft_tokens=ngram.num_draft_tokens(args),
            spec_below_running=args.speculative_disable_by_batch_size,
            model_drafts=(args.speculative_algorithm or "").upper() in ("SELF", "STANDALONE"),
        )

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"schedule_policy must be one of {POLICIES}, got {self.policy!r}")
        if self.cache not in ("radix", "table", "none"):
            raise ValueError(f"cache must be radix, table or none, got {self.cache!r}")
        for name in ("page_size", "chunked_prefill_size", "max_running_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class Stats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    retractions: int = 0
    steps: int = 0
    spec_rows: int = 0  # decoding rows that carried a draft (speculative decoding)
    spec_drafted: int = 0  # tokens drafted
    spec_accepted: int = 0  # drafted tokens the verify rows sampled too
    tree_seconds: float = 0.0  # match, lock, insert, evict, unlock: the RadixAttention bookkeeping
    admit_seconds: float = 0.0  # the whole admission (policy order, page accounting, its matches): the scheduler


class Scheduler:
    def __init__(self, cfg: SchedulerConfig):
        self.cfg = cfg
        self.page_size = cfg.page_size
        self.allocator = PageAllocator(cfg.num_pages)
        self.cache = make_cache(cfg.cache, self.allocator, cfg.page_size)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.new_token_ratio = cfg.init_new_token_ratio
        self.rng = np.random.default_rng(cfg.seed)
        self.stats = Stats()
        self._free_slots = list(range(cfg.max_running_requests - 1, -1, -1))
        # Engine.update_weights: the weights' generation (cached prefixes of other generations are never matched),
        # and whether waiting requests may start (off while running ones finish on the old weights)
        self.generation = 0
        self.admitting = True
        # SELF / STANDALONE: works -> each one's drafted tokens (Runner.draft), called once their pages are grown
        self.drafter = None
        self.adapters = None  # engine/adapters.Adapters: a LoRA request runs only once its adapter has a slot

    # -- queue ------------------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def live(self) -> list[Req]:
        """Every waiting and running request (a copy: aborting them changes the queues)."""
        return list(self.waiting) + list(self.running)

    def abort(self, rid: str) -> Req | None:
        """Drop a request at once: a waiting one leaves the queue, a running one frees its pages now."""
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.rid == rid:
                    queue.remove(req)
                    if queue is self.running:
                        self._release(req, keep=False)
                        self._free_slot(req)
                    return req
        return None

    def finish(self, req: Req) -> None:
        """A running request is done: cache its KV (whole pages) and drop its lock."""
        self.running.remove(req)
        self._release(req, keep=True)
        self._free_slot(req)

    def _free_slot(self, req: Req) -> None:
        if self.adapters is not None:
            self.adapters.release(req)
        if req.slot >= 0:
            self._free_slots.append(req.slot)
            req.slot = -1

    # -- one step ---------------------------------------------------------------------------------------
    def schedule(self, retract: bool = True) -> list[Work] | None:
        """The next batch: running requests' decode tokens and prefill chunks, then newly admitted requests.
        With retract=False, None (and nothing changed) where the running requests' pages would need a retraction."""
        plan = self._plan_running(retract)
        if plan is None:
            return None
        works = []
        budget = self._prefill_budget(sum(n for _, n, decode in plan if decode))
        for req, n, decode in plan:
            self._grow(req, req.kv_len + n)
            if decode and n > 1:  # a draft to verify: the newest output token, then the drafted ones
                drafted, states = req.draft, req.draft_states
                req.draft, req.draft_states = [], []
                tokens = [req.output_ids[-1], *drafted]
                works.append(Work(req, req.kv_len, tokens, sample=True, draft=drafted, fsm_states=states))
            elif decode:  # the newest output token is not part of the fill: its KV is computed now
                works.append(Work(req, req.kv_len, [req.output_ids[-1]], sample=True, decode=True))
            else:
                budget -= n
                works.append(self._work(req, n))
        if self.cfg.model_drafts:
            works = ngram.with_model_drafts(works, self.drafter)
        works += self._admit(budget)
        if works:
            self.stats.steps += 1
        return works

    def _plan_running(self, retract: bool = True) -> list[tuple[Req, int, bool]] | None:
        """(request, next token count, decodes) of the running requests, retracting some until their pages can be
        found."""
        while True:
            plan, need = [], 0
            rows = [(r, r.in_decode) for r in self.running]
            # a decoding request at max_new_tokens has its last token still on the device (overlap): it finishes
            # when that lands
            rows = [(r, d) for r, d in rows if not d or len(r.output_ids) < r.params.max_new_tokens]
            if self.cfg.num_draft_tokens > 1:  # every round: a draft left from a planning that retracted is stale
                speculating = self.speculating
                for req, decode in rows:
                    if not (speculating and decode):
                        req.draft, req.draft_states = [], []
                    elif self.cfg.model_drafts:  # placeholders: the device drafts once the pages are grown
                        req.draft, req.draft_states = [-1] * ngram.room(req, self.cfg.num_draft_tokens), []
                    else:
                        req.draft, req.draft_states = ngram.draft_for(req, self.cfg.num_draft_tokens)
            budget = self._prefill_budget(sum(1 + len(r.draft) for r, d in rows if d))
            for req, decode in rows:
                if decode:
                    n = 1 + len(req.draft)
                else:
                    n = min(req.fill_len - req.kv_len, budget)
                    budget -= n
                    if n <= 0:
                        continue
                plan.append((req, n, decode))
                need += self._pages_for(req.kv_len + n) - len(req.pages)
            if need <= self.allocator.num_free + self.cache.evictable_pages or not self.running:
                return plan
            if not retract:
                return None
            self._retract_one()

    @property
    def speculating(self) -> bool:
        """Whether the next step drafts (then the loop must read this step's tokens before scheduling it)."""
        cap = self.cfg.spec_below_running
        return self.cfg.num_draft_tokens > 1 and (cap is None or len(self.running) < cap)

    def _prefill_budget(self, decode_rows: int) -> int:
        """Prefill tokens this step may take: chunked_prefill_size less the step's decode rows, so that a mixed step
        stays in the chunk's token bucket (512 prefill tokens + 16 decode rows padded to 1024 computed twice the
        work), but never below a quarter of the chunk, so that prefills move while many requests decode."""
        chunk = self.cfg.chunked_prefill_size
        decode = decode_rows
        return max(chunk - decode, chunk // 4)

    def _retract_one(self) -> None:
        """Retract the running request with the least output (the longest prompt among ties), as SGLang does."""
        self.retract(min(self.running, key=lambda r: (len(r.output_ids), -len(r.input_ids), -r.arrival)))

    def retract(self, victim: Req, keep: bool = True) -> None:
        """A running request back to the head of the queue, its output kept: it resumes by prefilling prompt and
        output. `keep`: its whole computed pages go to the cache (else they are freed)."""
        t0 = time.perf_counter()
        self.running.remove(victim)
        self._release(victim, keep=keep)
        self._free_slot(victim)
        if not victim.input_logprobs_complete:
            victim.input_logprobs.clear()
            victim.input_top_logprobs.clear()
        victim.prefill_done = False  # resume by prefilling prompt + all output so far
        victim.draft_kv_len = 0  # its pages may change: a draft model reads the row again
        victim.retractions += 1
        self.waiting.insert(0, victim)
        self.stats.retractions += 1
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.2)
        self.stats.tree_seconds += time.perf_counter() - t0

    def _admit(self, budget: int) -> list[Work]:
        cfg = self.cfg
        room = cfg.max_running_requests - len(self.running)
        if not self.waiting or room <= 0 or budget <= 0 or not self.admitting:
            return []
        t0 = time.perf_counter()
        policy = cfg.policy if len(self.waiting) <= cfg.max_match_queue else "fcfs"
        if policy in ("lpm", "dfs-weight"):  # the order needs every match
            queue = self.waiting[: cfg.max_match_queue]
            matches = [self._match(r) for r in queue]
            order = schedule_order(policy, [m.num_tokens for m in matches], [m.last_node for m in matches], self.rng)
        else:  # the order ignores the cache: match only the requests we try to admit
            queue = self.waiting
            matches = [None] * len(queue)
            order = schedule_order(policy, matches, None, self.rng)
        reserve = sum(self._future_pages(r) for r in self.running)
        # Requests still prefilling (chunked) cache their prompt chunk by chunk: sharing with them also pays to wait.
        prefilling = [r for r in self.running if r.kv_len < r.fill_len or r.fill_in_flight]
        admitted: list[Req] = []
        works: list[Work] = []
        for i in order:
            if len(admitted) >= room or budget <= 0:
                break
            req, m = queue[i], matches[i]
            if m is None or (m.last_node is not None and m.last_node.value is None):
                m = self._match(req)  # an eviction for an earlier admission took its pages
            if policy in ("lpm", "dfs-weight") and self._shares_with(req, m.num_tokens, admitted + prefilling):
                continue
            self._timed(self.cache.lock, m.last_node)
            need = self._pages_for(req.fill_len) - len(m.pages)
            if self.running or admitted:  # a lone request only needs its prompt: it can always run to the end
                need += self._future_pages(req) + reserve
            if need > self.allocator.num_free + self.cache.evictable_pages:
                self._timed(self.cache.unlock, m.last_node)
                break
            if self.adapters is not None and not self.adapters.acquire(req):
                self._timed(self.cache.unlock, m.last_node)
                continue  # every slot serves other running requests' adapters
            req.pages, req.tree_pages, req.last_node, req.kv_len = (
                m.pages.copy(),
                len(m.pages),
                m.last_node,
                m.num_tokens,
            )
            req.match = None
            req.slot = self._free_slots.pop()
            if req.cached_tokens < 0:
                req.cached_tokens = m.num_tokens
                self.stats.cached_tokens += m.num_tokens
                self.stats.prompt_tokens += len(req.input_ids)
            n = min(req.fill_len - req.kv_len, budget)
            budget -= n
            self._grow(req, req.kv_len + n)
            works.append(self._work(req, n))
            admitted.append(req)
            reserve += self._future_pages(req)
        if admitted:
            ids = {id(r) for r in admitted}
            self.waiting = [r for r in self.waiting if id(r) not in ids]
            self.running += admitted
        self.stats.admit_seconds += time.perf_counter() - t0
        return works

    def _shares_with(self, req: Req, matched: int, admitted: list[Req]) -> bool:
        """True when `req` shares enough uncached prompt with a request admitted this round (or still prefilling)
        to wait for it."""
        threshold = self.cfg.in_batch_prefix_tokens
        if not admitted or len(req.input_ids) - matched < threshold:
            return False
        mine = req.input_array[: matched + threshold]
        for other in admitted:
            theirs = other.input_array[: len(mine)]
            if len(theirs) == len(mine) and np.array_equal(theirs, mine):
                return True
        return False

    def _work(self, req: Req, n: int) -> Work:
        start = req.kv_len
        fill = req.fill_ids
        end = start + n
        sample = end == req.fill_len and req.params.max_new_tokens > 0 and req.finish_after_fill is None
        work = Work(req, start, fill[start:end], sample=sample, completes_fill=end == req.fill_len)
        if req.wants_input_logprobs:
            # The logprob of prompt token i comes from the row of position i - 1.
            first = max(req.logprob_start_len, 1) - 1
            last = len(req.input_ids) - 1  # the last prompt row predicts an output token, not a prompt token
            work.prompt_rows = [(p - start, fill[p + 1]) for p in range(max(start, first), min(end, last))]
        if req.return_logprob:
            work.output_rows = _output_rows(req, fill, start, end)
        return work

    # -- after the step ---------------------------------------------------------------------------------
    def commit(self, works: list[Work], tokens, logprobs, top) -> list[Req]:
        """Record a step's results. Returns the requests that received a new output token (or finished prefill
        with max_new_tokens == 0). `tokens[i]`/`logprobs[i]`/`top[i]` are work i's sampled token, its logprob and
        its top logprobs; target-row logprobs come in `work.target_results`."""
        updated = []
        t_tree = 0.0
        tokens = tokens.tolist() if hasattr(tokens, "tolist") else tokens
        for i, w in enumerate(works):
            req = w.req
            if req.finished:  # finished or aborted while this step ran (the overlap loop): its row is dropped
                continue
            if w.draft:
                ngram.commit_draft(w, tokens[i], logprobs[i], top[i] if top is not None else None, self.stats)
                updated.append(req)
                continue
            if w.decode:  # most rows at scale: what the general path below does for a decode row, directly
                req.kv_len = w.start + 1
                out = req.output_ids
                if out[-1] < 0:  # the placeholder commit_ahead put there
                    out[-1] = tokens[i]
                else:
                    out.append(tokens[i])
                if req.return_logprob:
                    req.output_logprobs.append((float(logprobs[i]), tokens[i]))
                    req.output_top_logprobs.append(top[i] if top is not None else None)
                updated.append(req)
                continue
            req.kv_len = w.start + len(w.tokens)
            req.fill_in_flight = False
            for (_, target), (lp, tops) in zip(w.prompt_rows, w.target_results):
                if not req.input_logprobs and req.logprob_start_len == 0:
                    req.input_logprobs.append((None, req.input_ids[0]))
                    req.input_top_logprobs.append(None)
                req.input_logprobs.append((lp, target))
                req.input_top_logprobs.append(tops)
            for (_, target, index), (lp, tops) in zip(w.output_rows, w.target_results[len(w.prompt_rows) :]):
                if index < 0:  # prefill only: the next token's distribution, as upstream reports it
                    req.output_top_logprobs.append(tops)
                else:  # a forced token: the logprob it had, as if decoded
                    req.output_logprobs[index] = (lp, target)
                    req.output_top_logprobs[index] = tops
                    req.forced_pending -= 1
            if req.kv_len < req.fill_len:
                if self.cfg.cache != "none":
                    t0 = time.perf_counter()
                    self._cache_prefix(req)  # chunk boundary: later requests can match this chunk already
                    t_tree += time.perf_counter() - t0
                continue
            if w.completes_fill and self.cfg.cache != "none":
                t0 = time.perf_counter()
                self._cache_prefix(req)
                t_tree += time.perf_counter() - t0
            if req.return_logprob and req.logprob_start_len == 0 and not req.input_logprobs:
                req.input_logprobs.append((None, req.input_ids[0]))  # a one-token prompt has no rows
                req.input_top_logprobs.append(None)
            if w.sample:
                if req.output_ids and req.output_ids[-1] < 0:  # the placeholder commit_ahead put there
                    req.output_ids[-1] = tokens[i]
                else:
                    req.output_ids.append(tokens[i])
                if req.return_logprob:
                    req.output_logprobs.append((float(logprobs[i]), tokens[i]))
                    req.output_top_logprobs.append(top[i] if top is not None else None)
            req.prefill_done = True
            updated.append(req)
        self.stats.tree_seconds += t_tree
        self.new_token_ratio = max(self.cfg.min_new_token_ratio, self.new_token_ratio - self.cfg.new_token_ratio_decay)
        return updated

    def commit_ahead(self, works: list[Work]) -> None:
        """Record a dispatched step before its tokens are known (the overlap loop): each request's KV length
        advances, and a row that samples gets a placeholder -1 - slot for its new token, which the next step reads
        on the device; a chunk that completes the fill makes its request a decoding one. `commit` puts the real
        token in its place and caches the chunk's pages."""
        for w in works:
            req = w.req
            if req.finished:
                continue
            req.kv_len = w.start + len(w.tokens)
            if not w.decode:  # a prefill or extend chunk
                req.fill_in_flight = True
            if w.sample:
                req.output_ids.append(future_input(req.slot))
                req.prefill_done = True

    # -- pages ------------------------------------------------------------------------------------------
    def _namespace(self, req: Req):
        """The radix namespace of a request's KV: its own key (images) and the weights that computed it. A request
        holding no KV takes the current weights' generation; one paused in place across an update keeps its own,
        so nothing computed under old weights is ever matched under new ones."""
        if not len(req.pages):
            req.generation = self.generation
        return req.extra_key if req.generation == 0 else (req.extra_key, req.generation)

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _future_pages(self, req: Req) -> int:
        return self._pages_for(int(req.remaining_new_tokens * self.new_token_ratio))

    def _match(self, req: Req):
        """The cached prefix a request may reuse: never all of its fill (one token must run for the logits), and
        not past the first prompt row whose logprob it wants. A waiting request is matched in every admission
        round; its last match is reused while the tree has not changed under it, which on a long queue of long
        prompts saves reading every prompt again each round (the tree still sees the touch a match makes)."""
        limit = req.fill_len - 1
        if req.wants_input_logprobs:
            limit = min(limit, max(req.logprob_start_len - 1, 0))
        prev, clock = (req.match[1], req.match[2]) if req.match is not None and req.match[0] == limit else (None, 0)
        key = self._namespace(req)
        if self.cfg.match_cache and prev is not None and self.cache.unchanged_since(prev, clock, key):
            m = self._timed(self.cache.touch, prev)
        else:
            m = self._timed(self.cache.rematch, prev, req.fill_prefix(limit), key)
        req.match = (limit, m, self.cache.clock)
        return m

    def _timed(self, op, *args):
        """A cache operation, its time counted as RadixAttention bookkeeping."""
        t0 = time.perf_counter()
        out = op(*args)
        self.stats.tree_seconds += time.perf_counter() - t0
        return out

    def _grow(self, req: Req, num_tokens: int) -> None:
        need = self._pages_for(num_tokens) - len(req.pages)
        if need <= 0:
            return
        pages = self.allocator.alloc(need)
        if pages is None:
            t0 = time.perf_counter()
            self.cache.evict(need - self.allocator.num_free)
            self.stats.tree_seconds += time.perf_counter() - t0
            pages = self.allocator.alloc(need)
            if pages is None:
                raise RuntimeError("scheduler bug: admitted work without pages for it")
        req.pages = np.concatenate([req.pages, pages]) if len(req.pages) else pages

    def _cache_prefix(self, req: Req) -> None:
        """Hand the request's whole computed pages to the cache and point its page table at the cached copies."""
        full = req.kv_len // self.page_size
        if full <= req.tree_pages:
            return
        tokens = req.fill_prefix(full * self.page_size)
        held, key = self._held(req), self._namespace(req)
        self.cache.insert(tokens, req.pages[:full], key, below=held)
        m = self.cache.rematch(held, tokens, key)
        if m.num_tokens != len(tokens):
            raise RuntimeError(f"scheduler bug: inserted {len(tokens)} tokens but matched {m.num_tokens}")
        self.cache.lock(m.last_node)
        self.cache.unlock(req.last_node)
        req.pages = np.concatenate([m.pages, req.pages[full:]])
        req.tree_pages, req.last_node = full, m.last_node

    def _held(self, req: Req) -> MatchResult | None:
        """The request's locked cached prefix as a match: the tree's inserts and matches of its longer prefixes
        resume there instead of walking it again (the lock keeps it in the tree)."""
        if req.last_node is None:
            return None
        return MatchResult(req.pages[: req.tree_pages], req.last_node, req.tree_pages * self.page_size)

    def _release(self, req: Req, keep: bool) -> None:
        """Give back a request's pages: whole computed pages to the cache when `keep`, everything else freed."""
        t0 = time.perf_counter()
        full = req.kv_len // self.page_size
        if keep and self.cfg.cache != "none" and full > req.tree_pages:
            self.cache.insert(
                req.fill_prefix(full * self.page_size), req.pages[:full], self._namespace(req), below=self._held(req)
            )
            self.allocator.free(req.pages[full:])
        else:
            self.allocator.free(req.own_pages)
        self.cache.unlock(req.last_node)
        req.pages, req.tree_pages, req.last_node, req.kv_len = EMPTY, 0, None, 0
        self.stats.tree_seconds += time.perf_counter() - t0

    # -- checks and reports -----------------------------------------------------------------------------
    @property
    def in_flight_pages(self) -> int:
        return sum(len(r.own_pages) for r in self.running)

    def check_invariants(self) -> None:
        self.cache.check_invariants(in_flight=self.in_flight_pages)

    def flush_cache(self) -> bool:
        """Drop every cached prefix; refused (False) while requests run, as SGLang does."""
        if self.has_work:
            return False
        self.cache.reset()
        return True

    def report(self) -> dict:
        """The scheduler's, pool's and cache's gauges and counters (the engine's server info)."""
        a, c, st = self.allocator, self.cache, self.stats
        return {
            "schedule_policy": self.cfg.policy,
            "cache": self.cfg.cache,
            "num_pages": a.capacity,
            "free_pages": a.num_free,
            "evictable_pages": c.evictable_pages,
            "protected_pages": c.protected_pages,
            "pool_usage": 1.0 - a.num_free / a.capacity,
            "running_requests": len(self.running),
            "waiting_requests": len(self.waiting),
            "prompt_tokens": st.prompt_tokens,
            "cached_tokens": st.cached_tokens,
            "cache_hit_rate": self.hit_rate,
            "retractions": st.retractions,
            "spec_rows": st.spec_rows,
            "spec_drafted_tokens": st.spec_drafted,
            "spec_accepted_tokens": st.spec_accepted,
            # tokens a verifying row adds per step (SGLang's accept length): its accepted drafts plus one
            "spec_accept_length": (st.spec_rows + st.spec_accepted) / st.spec_rows if st.spec_rows else None,
            "steps": st.steps,
            "tree_seconds": st.tree_seconds,
            "admit_seconds": st.admit_seconds,
        }

    @property
    def hit_rate(self) -> float:
        return self.stats.cached_tokens / self.stats.prompt_tokens if self.stats.prompt_tokens else 0.0


def _output_rows(req: Req, fill: list[int], start: int, end: int) -> list[tuple[int, int, int]]:
    """A chunk's rows whose next token is an output token without a logprob yet (jump-forward's forced tokens), and,
    for a prefill-only request asking for top logprobs, its last row (index -1)."""
    base = len(req.input_ids)
    out = []
    for p in range(max(start, base - 1), end):
        index = p + 1 - base
        if index < len(req.output_ids) and req.output_logprobs[index][0] is None:
            out.append((p - start, fill[p + 1], index))
    if end == req.fill_len and req.params.max_new_tokens == 0 and req.top_logprobs_num > 0:
        out.append((end - 1 - start, 0, -1))
    return out
