"""The on-device sampler: float32 logits [L, V] -> one token (and logprobs) per logits row.

It runs inside the engine's jitted step, right after the model forward. Every row carries its own
sampling parameters (rows belong to different requests), and everything that varies per request is
an array, never a static argument, so one compiled program serves every mix of parameters; only the
shapes (L rows, a penalty window of W history entries, K top logprobs) are static.

Why it is built this way:

* Order (SGLang / vLLM / HF transformers): penalties -> constrained-decoding mask -> temperature ->
  top-k -> top-p -> min-p -> choose. Repetition penalty (HF's RepetitionPenaltyLogitsProcessor:
  divide positive logits by p, multiply negative ones by p) is applied first, over every token seen
  in the window, prompt or generated; then the OpenAI frequency (`-= f * count`) and presence
  (`-= p * (count > 0)`) penalties, which count generated tokens only (vLLM's order). Top-p runs on
  the distribution renormalised after top-k, as chained HF warpers do. The mask comes before the
  filters so that top-k / top-p choose among the allowed tokens only. `logit_bias` is added right after the
  penalties (SGLang's order); its entries share the penalty window (id + 2V, the bias in `bias`), so a request
  with a bias needs no new compiled shape beyond a window width.
* Gumbel-max sampling with a per-(seed, step) key: `argmax(logits + gumbel)` is an exact sample of
  softmax(logits), and the noise of a row is a counter-based hash of (seed, step, token id)
  (`noise_bits`: a few integer ops a value; jax.random's threefry, rounds over every value, was a large
  part of each CPU step's compile, docs/journal/engine-decisions.md). A request's token therefore
  depends only on its seed, how many tokens it has generated and its own logits: the same seed
  reproduces the same output whatever the batch composition, the row position or the padded batch
  size. Greedy rows (temperature 0 or top_k 1) take the argmax.
* The top-k / top-p / min-p filters need a sort over V (up to 128k) per row. The filters reduce to
  one logit threshold per row (ties at the threshold are kept), so the sorted copy is only read,
  never scattered back.
* Two parts are optional (`Branches`): the noise (only when some row samples) and the filters'
  sort (only when some row uses a filter). The host knows both when it packs the step. On an
  accelerator they are static parts of the step's shape: XLA:GPU runs a `lax.cond` by copying its
  predicate to the host and blocking until the stream reaches it, so a conditional after the
  forward made every dispatch wait for the whole forward (the overlap loop then hid nothing;
  docs/results/h200_probe_sampler_sync.jsonl). There
  the noise is always drawn (cheap next to the forward) and the filters are a shape flag. On a CPU
  a conditional blocks nothing and one program per shape keeps compiles few, so there the flags
  travel in the buffer and `lax.cond`s skip the work (`needs_filter`, and any sampling row).
* Logprobs are those of the raw model distribution, log_softmax of the unmodified logits (as the
  OpenAI API and SGLang report them): for a sampling row at the chosen token, for a prompt row
  (`target >= 0`) at the target token, which is what prompt-logprob selection needs. The top-K
  logprobs are over the same raw distribution.
* The per-row parameters travel host -> device inside one int32 buffer (`pack_sampling` /
  `unpack_sampling`), floats bit-cast so the round trip is exact.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sgjax.engine.sentinels import HISTORY_PAD, bias_token, is_bias_entry
from sgjax.model import packing
from sgjax.model.packing import Segment

Array = Any

# The per-row fields in buffer order: (name, host dtype, the "off" default).
ROW_FIELDS = (
    ("temperature", np.float32, 0.0),
    ("top_k", np.int32, 0),
    ("top_p", np.float32, 1.0),
    ("min_p", np.float32, 0.0),
    ("frequency_penalty", np.float32, 0.0),
    ("presence_penalty", np.float32, 0.0),
    ("repetition_penalty", np.float32, 1.0),
    ("seed", np.int32, 0),
    ("step", np.int32, 0),
    ("target", np.int32, -1),
    ("slot", np.int32, -1),  # the request's slot in the step's future-token array (the overlap loop); -1: none
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingBatch:
    """Sampling parameters, one entry per logits row (padded rows use `default_rows`' values)."""

    temperature: Array  # f32[L]; 0 means greedy (argmax)
    top_k: Array  # i32[L]; <= 0 means off; 1 means greedy
    top_p: Array  # f32[L]; >= 1 means off
    min_p: Array  # f32[L]; 0 means off
    frequency_penalty: Array  # f32[L]; 0 off
    presence_penalty: Array  # f32[L]; 0 off
    repetition_penalty: Array  # f32[L]; 1 off
    seed: Array  # i32[L]; the request's seed (any int32)
    step: Array  # i32[L]; tokens the request generated before this one
    target: Array  # i32[L]; -1: the row samples; >= 0: a prompt row, report the logprob of this token
    # i32[L, W]; token id (generated), id + V (prompt: repetition penalty only), id + 2V (logit_bias), -1 pad
    history: Array
    needs_filter: Array  # i32[]; 1 when any row uses top_k / top_p / min_p (Branches.filters None: else no sort)
    slot: Array = None  # i32[L]: where the step stores each row's sampled token for the next step (-1: nowhere)
    bias: Array = None  # f32[L, W]: the logit_bias of each id + 2V window entry (0 elsewhere); None: none


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SampleOutput:
    tokens: Array  # i32[L]: the chosen token (prompt rows: the argmax, to be ignored)
    logprobs: Array  # f32[L]: raw log_softmax at the token (sampling rows) or at the target (prompt rows)
    top_ids: Array  # i32[L, K]
    top_logprobs: Array  # f32[L, K]: top-K of the raw log_softmax


@dataclasses.dataclass(frozen=True)
class Branches:
    """The sampler's optional parts, fixed at trace time (True: run, False: skip) or None: decided on the device
    by a lax.cond (`draws`: any row samples; `filters`: the buffer's needs_filter). See the module docstring."""

    draws: bool | None = None
    filters: bool | None = None

    @staticmethod
    def for_step(static: bool, filters: bool) -> "Branches":
        """A step's branches: static (accelerators) always draws and sorts only when a row filters."""
        return Branches(draws=True, filters=filters) if static else Branches()


ON_DEVICE = Branches()


def _branch(static: bool | None, pred, yes, no):
    """yes() or no(): at trace time when `static` is a bool, else a lax.cond on the device predicate."""
    if static is None:
        return jax.lax.cond(pred, yes, no)
    return yes() if static else no()


# ----------------------------------------------------------------------------------------------
# Host side: default parameters and the packed int32 buffer.


def default_rows(num_rows: int, width: int) -> dict[str, np.ndarray]:
    """Host arrays with every parameter off: greedy, no penalties, target -1, empty history."""
    rows = {name: np.full(num_rows, value, dtype) for name, dtype, value in ROW_FIELDS}
    rows["history"] = np.full((num_rows, width), HISTORY_PAD, np.int32)
    rows["bias"] = np.zeros((num_rows, width), np.float32)
    rows["needs_filter"] = np.array(0, np.int32)
    return rows


def uses_filter(rows: dict[str, np.ndarray]) -> bool:
    """Whether any sampling row needs top-k / top-p / min-p (greedy rows never do)."""
    top_k = np.asarray(rows["top_k"])
    samples = (np.asarray(rows["temperature"]) > 0) & (top_k != 1) & (np.asarray(rows["target"]) < 0)
    filters = (top_k > 1) | (np.asarray(rows["top_p"]) < 1) | (np.asarray(rows["min_p"]) > 0)
    return bool(np.any(samples & filters))


def sampling_layout(num_rows: int, width: int) -> tuple[Segment, ...]:
    """The sampling rows' segments of the step buffer (model/packing.py): the per-row fields, the window and its
    biases, then the filter flag."""
    rows = tuple(Segment(name, (num_rows,), np.dtype(dtype).name) for name, dtype, _ in ROW_FIELDS)
    return rows + (
        Segment("history", (num_rows, width)),
        Segment("bias", (num_rows, width), "float32"),
        Segment("needs_filter", ()),
    )


def sampling_size(num_rows: int, width: int) -> int:
    return packing.size(sampling_layout(num_rows, width))


def sampling_values(rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The host rows as the layout's values. needs_filter is rows["needs_filter"] or'ed with `uses_filter(rows)`, so
    forgetting to set it cannot silently drop a filter."""
    num_rows, width = np.shape(rows["history"])
    bias = rows.get("bias")
    return {
        **{name: rows[name] for name, _, _ in ROW_FIELDS},
        "history": rows["history"],
        "bias": np.zeros((num_rows, width), np.float32) if bias is None else bias,
        "needs_filter": int(bool(np.any(rows.get("needs_filter", 0))) or uses_filter(rows)),
    }


def pack_sampling(rows: dict[str, np.ndarray]) -> np.ndarray:
    """All of a batch's sampling parameters in one int32 buffer (floats bit-cast, exact)."""
    num_rows, width = np.shape(rows["history"])
    return packing.pack(sampling_layout(num_rows, width), sampling_values(rows))


def from_values(d: dict) -> SamplingBatch:
    return SamplingBatch(**d)


def unpack_sampling(buffer, num_rows: int, width: int) -> SamplingBatch:
    """The inverse of pack_sampling, inside the jitted step (static slices of one buffer)."""
    return from_values(packing.unpack(sampling_layout(num_rows, width), jnp.asarray(buffer)))


# ----------------------------------------------------------------------------------------------
# Device side.


def _history_counts(history, vocab: int):
    """(count i32[L, V] of generated occurrences, seen bool[L, V] anywhere in the window).

    One scatter-add: a generated entry adds B + 1, a prompt entry B, with B = W + 1 > any count, so
    total = generated + B * (generated + prompt): total % B is the generated count, total >= B
    says the token was seen.
    """
    num_rows, width = history.shape
    big = width + 1
    valid = (history >= 0) & ~is_bias_entry(history, vocab)  # logit_bias entries count for nothing
    generated = valid & (history < vocab)
    weight = jnp.where(generated, big + 1, jnp.where(valid, big, 0)).astype(jnp.int32)
    ids = jnp.where(valid, history % vocab, 0)
    rows = jnp.arange(num_rows)[:, None]
    total = jnp.zeros((num_rows, vocab), jnp.int32).at[rows, ids].add(weight)
    return total % big, total >= big


def apply_penalties(logits, batch: SamplingBatch):
    """Repetition (HF), then frequency and presence (OpenAI) penalties, then logit_bias; a no-op when W == 0."""
    if batch.history.shape[1] == 0:
        return logits
    vocab = logits.shape[-1]
    count, seen = _history_counts(batch.history, vocab)
    rep = batch.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    count = count.astype(jnp.float32)
    logits = (
        logits
        - batch.frequency_penalty[:, None] * count
        - batch.presence_penalty[:, None] * (count > 0).astype(jnp.float32)
    )
    if batch.bias is None:
        return logits
    # Scattered straight into the logits (no [L, V] bias array); padding and penalty entries add 0 at id 0.
    is_bias = is_bias_entry(batch.history, vocab)
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, jnp.where(is_bias, bias_token(batch.history, vocab), 0)].add(
        jnp.where(is_bias, batch.bias, 0.0)
    )


def argmax(x):
    """jnp.argmax over the last axis (the first maximum; 0 for a row of NaN) as a max and a min: XLA's CPU runs
    argmax's (value, index) reduction unvectorized, several times slower (docs/journal/engine-cpu.md)."""
    vocab = x.shape[-1]
    best = jnp.max(x, axis=-1, keepdims=True)
    index = jnp.min(jnp.where(x == best, jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)
    return jnp.where(index == vocab, 0, index).astype(jnp.int32)


def _at(values, index):
    """values[r, index[r]] for every row r."""
    return jnp.take_along_axis(values, index[:, None], axis=-1)


def apply_filters(x, batch: SamplingBatch):
    """Top-k, top-p, min-p on temperature-scaled logits x [L, V]: -inf outside the kept set.

    Each filter keeps a prefix of the descending sort, so together they are one threshold per row;
    the top token is always kept.
    """
    vocab = x.shape[-1]
    desc = jnp.sort(x, axis=-1, descending=True)
    top = desc[:, :1]
    k = jnp.where(batch.top_k > 0, jnp.minimum(batch.top_k, vocab), vocab)
    kth = _at(desc, k - 1)
    desc = jnp.where(desc >= kth, desc, -jnp.inf)  # renormalise after top-k for top-p
    probs = jax.nn.softmax(desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1)
    mass_before = jnp.pad(mass_before[:, :-1], ((0, 0), (1, 0)))  # exclusive: monotone, starts at 0
    top_p = batch.top_p[:, None]
    in_top_p = (mass_before < top_p) | (top_p >= 1)
    pth = _at(desc, jnp.maximum(jnp.sum(in_top_p, axis=-1), 1) - 1)
    min_p_th = top + jnp.log(batch.min_p)[:, None]  # p >= min_p * p_max  <=>  x >= x_max + log(min_p)
    threshold = jnp.minimum(jnp.maximum(jnp.maximum(kth, pth), min_p_th), top)
    return jnp.where(x >= threshold, x, -jnp.inf)


def _usable(mask):
    """The mask, with all-False rows (an error the caller reports) opened up so nothing goes NaN."""
    return mask | ~jnp.any(mask, axis=-1, keepdims=True)


def process_logits(logits, batch: SamplingBatch, mask=None, branches: Branches = ON_DEVICE):
    """Penalised, masked, temperature-scaled, filtered logits (-inf where a token cannot be chosen).

    Greedy rows (temperature 0) are left unscaled; the filters run when `branches.filters` (None: needs_filter).
    """
    x = apply_penalties(logits.astype(jnp.float32), batch)
    if mask is not None:
        x = jnp.where(_usable(mask), x, -jnp.inf)
    x = x / jnp.where(batch.temperature > 0, batch.temperature, 1.0)[:, None]
    return _branch(branches.filters, batch.needs_filter > 0, lambda: apply_filters(x, batch), lambda: x)


def _mix32(x):
    """A bijective 32-bit integer hash with close to full avalanche (Wellons' `triple32`): shifts, xors and
    wrapping multiplies, the same bits on every backend."""
    for shift, factor in ((17, 0xED5AD4BB), (11, 0xAC4C1B51), (15, 0x31848BAB)):
        x = (x ^ (x >> shift)) * jnp.uint32(factor)
    return x ^ (x >> 14)


def noise_bits(seed, step, vocab: int):
    """uint32[L, V]: the noise bits of each row, a hash of (seed, step, token id) alone.

    A counter-based hash, not jax.random's threefry, whose 20 rounds over the L x V counters weighed on every CPU
    step's compile (a CPU step compiles its lax.cond's noise branch whether or not a row samples) and on the draw;
    this is a few ops a value. The row's key hashes the seed, then the step, so that neither a
    seed's next step nor the next seed repeats another row's noise; each value hashes its token id's hash xor
    the key twice."""
    u32 = jnp.uint32
    key = _mix32(_mix32(seed.astype(u32) ^ u32(0x9E3779B9)) ^ step.astype(u32))[:, None]
    ids = _mix32(jnp.arange(vocab, dtype=u32) + u32(0x85EBCA6B))[None, :]
    return _mix32(_mix32(ids ^ key) + key)


def _gumbel_argmax(x, seed, step):
    """Gumbel-max: one exact sample of softmax(x) per row, from the row's (seed, step) alone."""
    bits = noise_bits(seed, step, x.shape[-1])
    uniform = ((bits >> 8).astype(jnp.float32) + 0.5) * jnp.float32(2.0**-24)  # 24 bits, inside (0, 1)
    return argmax(x - jnp.log(-jnp.log(uniform)))


def _top_logprobs(logits, lse, k: int):
    """The K most likely tokens of the raw distribution; K is 0 when no row of the step asked for them."""
    if k == 0:
        rows = logits.shape[0]
        return jnp.zeros((rows, 0), jnp.int32), jnp.zeros((rows, 0), jnp.float32)
    values, ids = jax.lax.top_k(logits, k)
    return ids.astype(jnp.int32), values - lse[:, None]


def sample(
    logits, batch: SamplingBatch, *, num_top_logprobs: int = 0, mask=None, branches: Branches = ON_DEVICE
) -> SampleOutput:
    """Choose one token per row; see the module docstring. mask: optional bool[L, V], True = allowed."""
    logits = logits.astype(jnp.float32)
    x = process_logits(logits, batch, mask, branches)
    greedy = argmax(x)
    draws = (batch.temperature > 0) & (batch.top_k != 1) & (batch.target < 0)
    tokens = _branch(
        branches.draws,
        jnp.any(draws),
        lambda: jnp.where(draws, _gumbel_argmax(x, batch.seed, batch.step), greedy),
        lambda: greedy,
    )
    raw_argmax = argmax(logits)
    if mask is not None:
        tokens = jnp.where(jnp.any(mask, axis=-1), tokens, raw_argmax)
    tokens = jnp.where(batch.target >= 0, raw_argmax, tokens)
    lse = jax.nn.logsumexp(logits, axis=-1)
    chosen = jnp.clip(jnp.where(batch.target >= 0, batch.target, tokens), 0, logits.shape[-1] - 1)
    logprobs = _at(logits, chosen)[:, 0] - lse
    top_ids, top_logprobs = _top_logprobs(logits, lse, num_top_logprobs)
    return SampleOutput(tokens=tokens, logprobs=logprobs, top_ids=top_ids, top_logprobs=top_logprobs)
