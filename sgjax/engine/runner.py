"""The model runner: turns the scheduler's works into one padded ragged batch and runs the jitted step.

One step = forward + sampler in a single jitted program, fed by a single int32 buffer (the batch metadata and the
per-row sampling parameters, floats bit-cast) and returning only the sampled tokens and logprobs, so a step costs
one host->device and one device->host transfer and never syncs inside. The KV pool is donated.

Shapes come from buckets (engine/buckets.py): tokens T, requests R, logits rows L, page-table width P (the `ref`
backend reads every page-table entry, so under the fine ladder P follows the longest live context; the native and
Pallas kernels read only `kv_lens` pages, so P is fixed there), penalty history W (0 unless a request uses
penalties), top-logprobs K and mask words. Everything else is an array, so a steady workload compiles nothing new.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np

from sgjax.engine import mesh as tp
from sgjax.engine.buckets import Buckets, bucket
from sgjax.engine.drafter import jitted_draft
from sgjax.engine.embed import READOUTS, readout
from sgjax.engine.params import uses_penalties
from sgjax.engine.plan import StepPlan
from sgjax.engine.programs import COMPILE_LOCK, compiles, jitted_step
from sgjax.engine.sampler import default_rows, uses_filter
from sgjax.engine.sentinels import bias_entry, future_history, future_slot, prompt_entry
from sgjax.engine.shared import maps_near_limit
from sgjax.engine.step import DeviceState, StepShape
from sgjax.engine.step import pack as pack_step
from sgjax.engine.warmup import Warmup
from sgjax.engine.work import Work
from sgjax.kernels import allocate_pool
from sgjax.model.batch import BatchShape, build_batch
from sgjax.model.config import ModelConfig
from sgjax.model.weights import Weights

# A sampling row's temperature is float32: far above any logit range, larger values change nothing.
MAX_TEMPERATURE = 1e6

log = logging.getLogger("sgjax.engine")


class Runner(Warmup):
    def __init__(
        self,
        cfg: ModelConfig,
        weights: Weights,
        plan: StepPlan,
        *,
        num_pages: int,
        page_size: int,
        max_context: int,
        max_top_logprobs: int = 20,
        max_reqs: int = 64,
        mesh: jax.sharding.Mesh | None = None,
    ):
        """`weights` as the plan's step reads them (engine/loading.run_weights); `mesh`: tensor parallelism
        (engine/mesh.py), cfg then the sharded model's (mesh.tp_config)."""
        self.cfg, self.weights, self.plan, self.page_size, self.mesh = cfg, weights, plan, page_size, mesh
        self.attention = plan.attention
        self.platform = plan.platform
        self.buckets = Buckets(coarse=plan.buckets == "coarse", max_reqs=max_reqs, max_top_logprobs=max_top_logprobs)
        self.max_pages = -(-max_context // page_size)
        self.max_top_logprobs = max_top_logprobs
        self.num_pages = num_pages
        self.max_reqs = max_reqs
        self.state: DeviceState | None = None
        # Multi-host (engine/distributed.py): rank 0's Leader, which broadcasts every step (and pool reset) to the
        # followers before running it; None on one host and on the followers.
        self.leader = None
        self.multiprocess = mesh is not None and not all(
            d.process_index == jax.process_index() for d in mesh.devices.flat
        )
        self.reset_pool()
        self.step = jitted_step(cfg, plan, mesh)
        self.step_name = self.step.step_name
        self.shapes_seen: set[StepShape] = set()
        self.renewals = 0  # times the step's compiled shapes were dropped near the memory-map limit
        self.drafter = None  # speculation's jitted draft (engine/drafter.py), set by enable_drafts
        self.draft_model = None  # STANDALONE: (cfg, plan, weights) of the draft model, its pool in draft_pool
        self.draft_pool = None
        self._draft_shapes: set[tuple[int, int, int]] = set()
        self.adapters = None  # engine/adapters.Adapters (--enable-lora): its stacks go to every step

    def enable_lora(self, adapters) -> None:
        """Serve LoRA adapters: every step shape carries each token row's slot, and every step reads the slots'
        matrices (a new shape set: nothing compiled without them is reused)."""
        self.adapters = adapters
        self.shapes_seen.clear()

    @property
    def _extra(self) -> dict:
        """The step's keyword arguments beyond the buffer (the same in every call, precompiled ones included, so
        jit's cache finds the compiled shape)."""
        return {} if self.adapters is None else {"lora": self.adapters.stacks}

    def reset_pool(self) -> None:
        """A fresh DeviceState (donated to every step, so a failed step may take it)."""
        cfg = self.cfg
        mesh = self.mesh
        if self.leader is not None:
            self.leader.reset()
        pool = allocate_pool(
            cfg.num_layers,
            self.num_pages,
            self.page_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            dtype=jnp.dtype(self.plan.kv_dtype),
            sharding=None if mesh is None else tp.pool_sharding(mesh),
        )
        place = self._to_device if mesh is not None else jnp.asarray
        future = place(np.zeros(self.max_reqs, np.int32))
        expert_tokens = place(np.zeros((cfg.num_layers, cfg.num_experts), np.int32)) if cfg.is_moe else None
        self.state = DeviceState(pool=pool, future=future, expert_tokens=expert_tokens)
        self._expert_base = None  # the warm-up's routing (host), left out of the report
        if getattr(self, "draft_model", None) is not None:  # its KV goes with the pool's (drafts only lose hits)
            self._reset_draft_pool()

    def report(self) -> dict:
        """The runner's part of the server info: its step plan, the shapes it compiled, and a mixture of experts'
        routing since the pool was made ((token, choice) pairs per layer and expert; none for a lost state). Waits
        for the steps in flight: the engine asks between steps."""
        cfg, plan = self.cfg, self.plan
        out = {
            "attention_backend": plan.attention,
            "dtype": plan.dtype,
            "weight_dtype": plan.weight_dtype,
            "kv_cache_dtype": plan.kv_dtype,
            "matmul": plan.matmul,
            "step_plan": plan.describe(),
            "compiled_shapes": len(self.shapes_seen),
            "step_renewals": self.renewals,
            "traces": self.traces,
        }
        if cfg.is_moe:
            out["moe_kernel"] = plan.moe_kernel
        state = self.state
        if state is not None and state.expert_tokens is not None and not state.lost():
            counts = np.asarray(jax.device_get(tp.local_value(state.expert_tokens)))
            out["expert_tokens"] = (counts - (0 if self._expert_base is None else self._expert_base)).tolist()
        return out

    def _to_device(self, host: np.ndarray):
        """A step input: replicated over the mesh (what the compiled step expects), else on the default device."""
        if self.mesh is None:  # device_put, not jnp.asarray: that compiles a `stage` program per new buffer size
            return jax.device_put(host)
        if self.multiprocess:  # each process gives its own devices' copies (device_put needs addressable devices)
            return jax.make_array_from_callback(host.shape, tp.replicated(self.mesh), lambda idx: host[idx])
        return jax.device_put(host, tp.replicated(self.mesh))

    def execute(self, buffer: np.ndarray, shape: StepShape, features: np.ndarray | None = None):
        """Run one step on the device (asynchronously): rank 0 announces it to the followers first, which call this
        too with the same arguments (engine/distributed.py). Returns the step's SampleOutput."""
        if self.leader is not None:
            self.leader.step(shape, buffer, features)
        # features only when there are some: the call must match the precompiled (lowered) one to hit jit's cache
        extra = () if features is None else (self._to_device(features),)
        if shape in self.shapes_seen:
            out, self.state = self.step(self.weights, self.state, self._to_device(buffer), shape, *extra, **self._extra)
            return out
        # A new shape compiles here, on the engine thread (jax writes it to its persistent cache), once the step in
        # flight is done and never beside another thread's compile (COMPILE_LOCK): one compile's memory at a time.
        jax.block_until_ready(self.state)
        self._renew_if_near_the_map_limit()
        with COMPILE_LOCK:
            out, self.state = self.step(self.weights, self.state, self._to_device(buffer), shape, *extra, **self._extra)
            jax.block_until_ready(out)
        self.shapes_seen.add(shape)
        return out

    def _renew_if_near_the_map_limit(self) -> None:
        """Each compiled shape holds memory maps of its own, and a process past vm.max_map_count cannot map the next
        program (XLA fails to link it, and the process dies: issue #42). Past MAP_BUDGET of the limit this step's
        shapes are dropped, to compile again (from the persistent cache) as traffic needs them."""
        near = maps_near_limit() if self.shapes_seen else None  # a step holding no shape frees nothing
        if near is None:
            return
        log.warning(
            "this process holds %d memory maps of the %d allowed (vm.max_map_count): dropping this engine's %d "
            "compiled step shapes, which compile again as they are needed",
            *near,
            len(self.shapes_seen),
        )
        self.step = jitted_step(self.cfg, self.plan, self.mesh, renew=True)
        self.step_name = self.step.step_name
        self.shapes_seen.clear()
        self.renewals += 1

    def enable_drafts(self, k: int, layers: int | None = None, draft=None) -> None:
        """Speculation with a model drafting k tokens a row (engine/drafter.py): the first `layers` layers of this
        one (SELF), or draft = (cfg, plan, weights) of a smaller model (STANDALONE) with a pool of its own over the
        same pages."""
        if self.leader is not None or self.multiprocess:
            raise ValueError(
                "speculative decoding with a draft model runs on one host (drafts are not sent to followers)"
            )
        self.draft_model = draft
        if draft is None:
            self.drafter = jitted_draft(self.cfg, self.plan, self.mesh, self.page_size, layers, k)
        else:
            dcfg, dplan, _ = draft
            self.drafter = jitted_draft(dcfg, dplan, None, self.page_size, None, k)
            self._reset_draft_pool()

    def _reset_draft_pool(self) -> None:
        dcfg, dplan, _ = self.draft_model
        self.draft_pool = allocate_pool(
            dcfg.num_layers, self.num_pages, self.page_size, dcfg.num_kv_heads, dcfg.head_dim, jnp.dtype(dplan.kv_dtype)
        )

    def draft(self, works: list[Work]) -> list[list[int]]:
        """Each decoding work's k drafted tokens after its newest one (tokens[0], at position start). The drafter
        first reads what it has not seen of the row (SELF: the newest token; a draft model: everything past
        Req.draft_kv_len), then drafts one token a forward; the scheduler grew the pages the verify step writes."""
        standalone = self.draft_model is not None
        n = len(works)
        chunks = []
        for w in works:
            seen = min(w.req.draft_kv_len, w.start) if standalone else w.start
            unseen = w.req.fill_prefix(w.start)[seen:].tolist() if seen < w.start else []  # SELF: none, no copy
            chunks.append([*unseen, w.tokens[0]])
        ends = [w.start + 1 for w in works]
        tables = [w.req.pages for w in works]
        width = self._width(max(len(p) for p in tables))
        tables = [p[:width] for p in tables]
        first_tokens = self.buckets.tokens(sum(map(len, chunks)))
        step_tokens = self.buckets.tokens(n)
        reqs = max(self.buckets.reqs(first_tokens, n), self.buckets.reqs(step_tokens, n))
        first = build_batch(chunks, ends, tables, self.page_size, first_tokens, reqs, width, num_logits=reqs)
        step = build_batch([[0]] * n, [e + 1 for e in ends], tables, self.page_size, step_tokens, reqs, width)
        weights, pool = (self.draft_model[2], self.draft_pool) if standalone else (self.weights, self.state.pool)
        args = (weights, pool, *(jax.tree.map(self._to_device, b) for b in (first, step)))
        shape = (first_tokens, step_tokens, reqs, width)
        if shape in self._draft_shapes:
            drafts, pool = self.drafter(*args)
        else:  # compiles on the engine thread, one compile at a time (as execute does)
            jax.block_until_ready(pool)
            with COMPILE_LOCK:
                drafts, pool = self.drafter(*args)
                jax.block_until_ready(drafts)
            self._draft_shapes.add(shape)
        if standalone:
            self.draft_pool = pool
            for w in works:
                w.req.draft_kv_len = w.start + 1
        else:
            self.state = dataclasses.replace(self.state, pool=pool)
        return np.asarray(jax.device_get(tp.local_value(drafts)))[:n].tolist()

    def readout(self, kind: str, prompts: list[list[int]]) -> np.ndarray:
        """A whole-prompt readout (engine/embed.py) on the serving weights over a scratch pool; rank 0 announces
        it to the followers first, as it does a step."""
        if self.leader is not None:
            self.leader.readout(READOUTS.index(kind), prompts)
        return readout(self.cfg, self.weights, self.plan, self.page_size, prompts, kind, self.mesh, self._to_device)

    def release(self) -> None:
        """Drop the device state and the step (shutdown): the pool's memory goes back to the device, and the
        step's compiled programs are freed once no engine holds it (engine/shared.py), even while this runner
        itself is still referenced."""
        self.state = None
        self.step = None
        self.drafter = self.draft_pool = self.draft_model = None

    @property
    def pool(self):
        return None if self.state is None else self.state.pool

    def pool_lost(self) -> bool:
        return self.state is None or self.state.lost()

    @property
    def traces(self) -> int:
        """Executables of this runner's step so far (shared by every engine on the same model and backend)."""
        return compiles(self.step_name)

    def _width(self, pages: int) -> int:
        # the kernels read only each row's pages (kv_lens), so a wide table costs nothing and compiles nothing new
        if self.attention != "ref" or self.buckets.coarse:
            return self.max_pages
        return min(bucket(pages, 16), self.max_pages)

    def run(self, works: list[Work]):
        """Run one step. Returns (tokens, logprobs, top) per work and fills each work's target_results."""
        return self.collect(works, self.dispatch(works))

    def dispatch(self, works: list[Work]):
        """Start a step on the device and return at once (jax dispatches asynchronously); `collect` waits for it.
        A work's token may be a placeholder -1 - slot for a token the previous step sampled (Req.slot)."""
        buffer, shape, sample_rows, prompt_rows, features = self.prepare(works)
        return self.execute(buffer, shape, features), sample_rows, prompt_rows

    def collect(self, works: list[Work], handle):
        out, sample_rows, prompt_rows = handle
        tokens, logprobs, top_ids, top_lps = jax.device_get(
            tuple(map(tp.local_value, (out.tokens, out.logprobs, out.top_ids, out.top_logprobs)))
        )
        return self._unpack_results(works, sample_rows, prompt_rows, tokens, logprobs, top_ids, top_lps)

    def prepares(self, works: list[Work]) -> bool:
        """Whether the host side of a step of these works builds (the engine's check for the row that failed one)."""
        try:
            self.prepare(works)
            return True
        except Exception:  # noqa: BLE001 - any failure means this row cannot run
            return False

    def prepare(self, works: list[Work]):
        """Host side of a step: the packed buffer, its static shape, and where each work's rows are."""
        chunks = [w.tokens for w in works]
        kv_lens = [w.start + len(w.tokens) for w in works]
        tables = [w.req.pages for w in works]
        sample_rows, prompt_rows, logits_rows = [], [], []
        t = 0
        for w in works:
            prompt_rows.append([len(logits_rows) + j for j in range(len(w.target_rows))])
            logits_rows += [t + r for r, _ in w.target_rows]
            logits_rows += [t + i for i in range(len(w.draft))]  # a draft's rows: just before its sample row
            sample_rows.append(len(logits_rows) if w.sample else -1)
            if w.sample:
                logits_rows.append(t + len(w.tokens) - 1)
            t += len(w.tokens)
        num_tokens = self.buckets.tokens(t)
        num_reqs = self.buckets.reqs(num_tokens, len(works))
        num_logits = self.buckets.logits(len(logits_rows), num_reqs, num_tokens)
        width = self._width(max(len(p) for p in tables))
        batch = build_batch(
            chunks,
            kv_lens,
            [p[:width] for p in tables],
            self.page_size,
            num_tokens,
            num_reqs,
            width,
            logits_rows=logits_rows,
            num_logits=num_logits,
        )
        rows, history, top_k = self._sampling_rows(works, num_logits, sample_rows, prompt_rows)
        masks = self._masks(works, num_logits, sample_rows)
        which, features = self._image_rows(works, num_tokens)
        shape = StepShape(
            BatchShape.of(batch),
            history,
            top_k,
            0 if masks is None else masks.shape[1],
            0 if features is None else features.shape[0],
            self.buckets.branches(bool(rows["needs_filter"])),
            lora=int(self.adapters is not None),
        )
        slots = None
        if self.adapters is not None:
            slots = np.full(num_tokens, -1, np.int32)
            slots[:t] = np.repeat([w.req.lora_slot for w in works], [len(w.tokens) for w in works])
        buffer = pack_step(shape, batch, rows, which, masks, slots)
        return buffer, shape, sample_rows, prompt_rows, features

    def _image_rows(self, works, num_tokens):
        """For a step whose chunks cover image positions: each token row's feature row (-1: none) and the
        feature rows (M padded to a power of two); (None, None) otherwise."""
        found, t = [], 0
        for w in works:
            images = w.req.images
            if images is not None:
                pos, feats = images.rows_in(w.start, w.start + len(w.tokens))
                if len(pos):
                    found.append((t + pos - w.start, feats))
            t += len(w.tokens)
        if not found:
            return None, None
        rows = np.concatenate([r for r, _ in found])
        feats = np.concatenate([f for _, f in found])
        which = np.full(num_tokens, -1, np.int32)
        which[rows] = np.arange(len(rows), dtype=np.int32)
        padded = np.zeros((bucket(len(rows), 16), feats.shape[1]), np.float32)
        padded[: len(rows)] = feats
        return which, padded

    def _masks(self, works, num_logits, sample_rows):
        """Packed allowed-token bits per logits row (all ones for unconstrained rows), or None when no row is
        constrained. The FSM state lives on the host, which needs every token anyway (stops, jump-forward), so
        the mask row is copied from the grammar's table: ceil(V/32) words per row, in the step's one buffer.
        A request short of min_new_tokens also masks its stop tokens (EOS, stop_token_ids), as SGLang and HF do."""
        constrained = [
            (w, r) for w, r in zip(works, sample_rows) if r >= 0 and (w.req.grammar is not None or _banned(w.req))
        ]
        if not constrained:
            return None
        words = -(-self.cfg.vocab_size // 32)
        masks = np.full((num_logits, words), -1, np.int32)
        for w, row in constrained:
            req = w.req
            if req.grammar is not None:  # within the tokens the request has left (fsm/completion.py)
                # a draft's rows (just before its sample row): the state its drafted tokens reach, one token less left
                for j, state in enumerate(w.fsm_states or [req.fsm_state]):
                    r = row - len(w.draft) + j
                    bits = req.grammar.mask_within(state, req.remaining_new_tokens - j)
                    masks[r, : len(bits)] = bits
                    masks[r, len(bits) :] = 0  # model ids past the tokenizer's vocabulary are never allowed
            banned = [t for t in _banned(w.req) if 0 <= t < self.cfg.vocab_size]
            if banned:
                cleared = masks[row].view(np.uint32).copy()
                ids = np.asarray(banned)
                np.bitwise_and.at(cleared, ids // 32, ~(np.uint32(1) << (ids % 32).astype(np.uint32)))
                if cleared.any():  # a grammar that allows nothing but a stop token keeps it: the grammar wins
                    masks[row] = cleared.view(np.int32)
        return masks

    def _sampling_rows(self, works, num_logits, sample_rows, prompt_rows):
        vocab = self.cfg.vocab_size
        windowed = [w for w in works if w.sample and (uses_penalties(w.req.params) or w.req.params.logit_bias)]
        histories = {id(w): _window(w.req, vocab) for w in windowed}
        # A coarse ladder: the history length varies with every prompt, and each width is a compilation.
        width = bucket(max(len(ids) for ids, _ in histories.values()), 64, factor=4) if histories else 0
        wanted = max((w.req.top_logprobs_num for w in works if w.req.return_logprob), default=0)
        top = self.buckets.top(wanted)
        rows = default_rows(num_logits, width)
        for w, srow, prows in zip(works, sample_rows, prompt_rows):
            for row, (_, target) in zip(prows, w.target_rows):
                rows["target"][row] = target
            if srow < 0:
                continue
            p, req = w.req.params, w.req
            k = len(w.draft)
            # a draft's row j samples as decoding would after j drafted tokens: the same seed, step + j; the host
            # picks the accepted token, so no row leaves it in the future array
            for j, row in enumerate(range(srow - k, srow + 1)):
                rows["seed"][row] = req.seed
                rows["step"][row] = len(req.output_ids) + j
                rows["slot"][row] = -1 if k else req.slot
                if not p.is_greedy:
                    rows["temperature"][row] = min(p.temperature, MAX_TEMPERATURE)  # beyond it: uniform already
                    rows["top_k"][row] = 0 if p.top_k >= vocab else max(p.top_k, 0)  # top_k >= V: no top-k
                    rows["top_p"][row] = p.top_p
                    rows["min_p"][row] = p.min_p
            h = histories.get(id(w))
            if h is not None:  # a penalised or biased row (the rest keep default_rows' neutral values)
                rows["frequency_penalty"][srow] = p.frequency_penalty
                rows["presence_penalty"][srow] = p.presence_penalty
                rows["repetition_penalty"][srow] = p.repetition_penalty
                ids, bias = h
                rows["history"][srow, : len(ids)] = ids
                rows["bias"][srow, : len(ids)] = bias
        rows["needs_filter"] = np.asarray(int(uses_filter(rows)), np.int32)  # the shape's filter flag reads it too
        return rows, width, top

    def _unpack_results(self, works, sample_rows, prompt_rows, tokens, logprobs, top_ids, top_lps):
        k = top_ids.shape[1]

        def tops(row, req):
            if not (req.return_logprob and req.top_logprobs_num and k):
                return None
            n = min(req.top_logprobs_num, k)
            return [(float(top_lps[row, j]), int(top_ids[row, j])) for j in range(n)]

        out_tokens, out_lps, out_top = [], [], []
        for w, srow, prows in zip(works, sample_rows, prompt_rows):
            w.target_results = [(float(logprobs[r]), tops(r, w.req)) for r in prows]
            if w.draft:
                rows = range(srow - len(w.draft), srow)
                w.draft_results = [(int(tokens[r]), float(logprobs[r]), tops(r, w.req)) for r in rows]
            out_tokens.append(int(tokens[srow]) if srow >= 0 else -1)
            out_lps.append(float(logprobs[srow]) if srow >= 0 else 0.0)
            out_top.append(tops(srow, w.req) if srow >= 0 else None)
        return out_tokens, out_lps, out_top


def _window(req, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """The sampler's window of one row (ids, biases): the penalty history when penalised, then the logit_bias
    entries as id + 2V with their biases (0 for the history's entries)."""
    hist = _history(req, vocab) if uses_penalties(req.params) else np.zeros(0, np.int32)
    pairs = req.params.logit_bias
    ids = bias_entry(np.asarray([t for t, _ in pairs], np.int32).reshape(-1), vocab)
    bias = np.concatenate([np.zeros(len(hist), np.float32), np.asarray([b for _, b in pairs], np.float32)])
    return np.concatenate([hist, ids]), bias


def _history(req, vocab: int) -> np.ndarray:
    """The sampler's penalty window: generated ids, then the prompt's distinct ids + vocab (repetition only).
    A token still on the device (the overlap loop's placeholder -1 - slot) enters as -2 - slot: -1 pads."""
    out = np.asarray(req.output_ids, np.int32)
    out = np.where(out < 0, future_history(future_slot(out)), out)  # the placeholder's slot, as a window entry
    if req.params.repetition_penalty == 1.0:
        return out
    prompt = prompt_entry(np.unique(np.asarray(req.input_ids, np.int32)), vocab)
    return np.concatenate([out, prompt])


def _banned(req) -> tuple:
    """The tokens a request may not sample yet: its stop tokens while it is short of min_new_tokens."""
    return req.min_tokens_stops if len(req.output_ids) < req.params.min_new_tokens else ()
