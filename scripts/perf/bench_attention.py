"""Benchmark ragged paged attention on a GPU: `pallas` vs `ref` under XLA vs jax's deprecated paged_attention.

Llama-3-8B attention shapes (32 query heads, 8 KV heads, head_dim 128, page 16, bf16; `--shape smollm2`: 9, 3,
64, float32). For each case: the median time of one backend call (KV write + attention, as the model pays it;
jax's op does no write), achieved HBM GB/s over the copy bandwidth measured in this run, and TFLOP/s over the
matmul rate in the case's dtype measured in this run. Inputs are random; each timed call cycles through enough page
tables over disjoint pages that its KV data exceeds 3x the L2 cache.

    PYTHONPATH=... python3 scripts/perf/bench_attention.py --out results.json [--sweep] [--cases
    decode-32x4k,prefill-4k]
        [--per-layer decode-32x4k,prefill-4k --layers 8]

--per-layer also times the case as the model runs it: one batch through every layer of an 8-layer pool in one
jit (unrolled, as on the GPU), per layer. The per-call rows rebuild the block table each call (each call has its
own metadata); in a step it is the same for every layer, so XLA computes it once.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from sgjax.kernels import AttentionMetadata, pallas_attention, ref_attention

HQ, HKV, D, PAGE, LAYERS, DTYPE, ITEM = 32, 8, 128, 16, 2, jnp.bfloat16, 2
# --shape: the attention shapes of a model (query heads, KV heads, head_dim, dtype); main() sets the globals
SHAPES = {"llama3-8b": (32, 8, 128, jnp.bfloat16), "smollm2": (9, 3, 64, jnp.float32)}
L2_BYTES = 60 << 20


def _median_time(fn, state, reps):
    """fn(state) -> state; median wall seconds of `reps` calls after a warm-up, synchronised."""
    state = jax.block_until_ready(fn(state))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        state = jax.block_until_ready(fn(state))
        times.append(time.perf_counter() - t)
    return float(np.median(times)), state


def warm_up(seconds=2.0):
    """Bring the clocks up (they idle at a few hundred MHz) before measuring the ceilings."""
    a = jax.random.normal(jax.random.key(3), (8192, 8192), DTYPE)
    f = jax.jit(lambda x: x @ x)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        jax.block_until_ready(f(a))


def torch_ceilings():
    """The same two ceilings through PyTorch (cudaMemcpy D2D; cuBLAS), timed with CUDA events.

    Run before JAX touches the GPU (JAX preallocates most of its memory). {} without torch or CUDA.
    """
    try:
        import torch
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}

    def event_median(fn, reps=20):
        for _ in range(3):
            fn()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return float(np.median(times))

    x = torch.randn(1 << 31, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    bw = 2 * x.numel() * 2 / event_median(lambda x=x, y=y: y.copy_(x))
    del x, y
    a, b = (torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    mm = 2 * 8192**3 / event_median(lambda a=a, b=b: a @ b)
    del a, b
    torch.cuda.empty_cache()
    return dict(torch_copy_bytes_per_s=bw, torch_matmul_flops_per_s=mm)


def copy_bandwidth():
    """Bytes read + written per second by the fastest of a few 4 GiB elementwise copies."""
    best = 0.0
    for shape, dtype, fn in (
        ((32768, 65536), DTYPE, lambda a: a + jnp.asarray(1, DTYPE)),
        ((32768, 32768), jnp.float32, lambda a: a * 2.0),
    ):
        x = jax.random.normal(jax.random.key(0), shape, dtype)
        q = shape[0] // 4  # 4 launches per call, so dispatch weighs less in the time
        f = jax.jit(lambda a: [fn(a[i * q : (i + 1) * q]) for i in range(4)])
        t, _ = _median_time(lambda s, x=x: f(x), None, 10)
        best = max(best, 2 * x.nbytes / t)
        del x
    return best


def matmul_rate():
    """bf16 8192^3 products on random data, 8 per call."""
    n = 8192
    a = jax.random.normal(jax.random.key(1), (8, n, n), DTYPE)
    b = jax.random.normal(jax.random.key(2), (n, n), DTYPE)
    f = jax.jit(lambda x, y: [x[i] @ y for i in range(8)])
    t, _ = _median_time(lambda s: f(a, b), None, 10)
    return 8 * 2 * n**3 / t


def build_case(q_lens, kv_lens, seed=0, layers=LAYERS, n_rot=None):
    """Random pool, n_rot metadata/q/k/v sets over disjoint pages, bytes and flops of one call."""
    rng = np.random.default_rng(seed)
    reqs, per_req = len(q_lens), max(-(-k // PAGE) for k in kv_lens)
    kv_bytes = sum(kv_lens) * HKV * D * 2 * ITEM
    # Enough sets that one call's KV exceeds 3x L2, at least 8 to spread the dispatch, at most ~24 GB.
    n_rot = n_rot or int(min(16, max(8, math.ceil(3 * L2_BYTES / kv_bytes)), max(2, (24 << 30) // kv_bytes)))
    num_pages = 1 + n_rot * reqs * per_req
    pool = jax.random.normal(jax.random.key(seed), (layers, num_pages, PAGE, 2 * HKV, D), DTYPE)
    t = sum(q_lens)
    sets = []
    perm = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
    for i in range(n_rot):
        table = perm[i * reqs * per_req : (i + 1) * reqs * per_req].reshape(reqs, per_req)
        slots = np.concatenate(
            [
                table[r, pos // PAGE] * PAGE + pos % PAGE
                for r, (ql, kl) in enumerate(zip(q_lens, kv_lens))
                for pos in [np.arange(kl - ql, kl)]
            ]
        )
        meta = AttentionMetadata(
            slot_mapping=jnp.asarray(slots, jnp.int32),
            cu_q_lens=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
            kv_lens=jnp.asarray(kv_lens, jnp.int32),
            page_table=jnp.asarray(table),
        )
        key = jax.random.key(100 + i)
        q, k, v = (
            jax.random.normal(jax.random.fold_in(key, j), (t, h, D), DTYPE) for j, h in enumerate((HQ, HKV, HKV))
        )
        sets.append((q, k, v, meta))
    causal_keys = sum(kl - ql + (j + 1) for ql, kl in zip(q_lens, kv_lens) for j in range(ql))
    flops = 4 * HQ * D * causal_keys
    io_bytes = kv_bytes + 2 * t * HQ * D * ITEM  # KV read once, q read, out written
    return pool, sets, io_bytes, flops


def time_backend(attend, pool, sets, reps):
    """Median seconds of one `attend` call; the pool is donated and threaded through, as in the model."""
    sm_scale = D**-0.5

    @functools.partial(jax.jit, donate_argnums=(0,))
    def run(pool, sets):
        outs = []
        for q, k, v, meta in sets:
            out, pool = attend(q, k, v, pool, jnp.int32(1), meta, sm_scale=sm_scale)
            outs.append(out)
        return pool, outs

    t, (pool, outs) = _median_time(lambda s: run(s[0], sets), (pool, None), reps)
    return t / len(sets), pool, outs[0]


def time_per_layer(attend, pool, one_set, reps):
    """Median seconds per layer of `attend` over every layer of the pool with one batch's metadata, unrolled
    in one jit as the model runs on the GPU: what a step pays per layer (the KV write and the kernel each
    layer; the block table, identical across layers, once per step after XLA's CSE)."""
    sm_scale = D**-0.5
    q, k, v, meta = one_set
    layers = pool.shape[0]

    @functools.partial(jax.jit, donate_argnums=(0,))
    def run(pool):
        outs = []
        for layer in range(layers):
            out, pool = attend(q, k, v, pool, jnp.int32(layer), meta, sm_scale=sm_scale)
            outs.append(out)
        return pool, outs

    t, (pool, outs) = _median_time(lambda s: run(s[0]), (pool, None), reps)
    return t / layers, pool, outs[0]


def time_jax_paged(pool, sets, reps):
    """jax.experimental.pallas.ops.gpu.paged_attention (decode only, its own [Hkv, N, S, D] K and V)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
    k_pages = jnp.transpose(pool[1, :, :, 0::2], (2, 0, 1, 3))
    v_pages = jnp.transpose(pool[1, :, :, 1::2], (2, 0, 1, 3))
    per_req = sets[0][3].page_table.shape[1]
    op = functools.partial(
        paged_attention, k_splits=min(16, per_req), pages_per_compute_block=8, interpret=jax.default_backend() == "cpu"
    )
    # The op has no softmax scale: give it pre-scaled queries (scaled here, outside the timing).
    sets = [((q * D**-0.5).astype(q.dtype), m) for q, _, _, m in sets]
    run = jax.jit(lambda kp, vp, sets: [op(q, kp, vp, m.page_table, m.kv_lens) for q, m in sets])
    t, outs = _median_time(lambda s: run(k_pages, v_pages, sets), None, reps)
    return t / len(sets), outs[0]


def glue_only(q, k, v, pool, layer, meta, *, sm_scale):
    """What the pallas backend does around its kernel: KV write and the block table (no attention)."""
    from sgjax.kernels import ragged_blocks as rb
    from sgjax.kernels.kv_pool import write_kv

    pool = write_kv(pool, layer, k, v, meta.slot_mapping)
    blocks = rb.block_table(meta, q.shape[0], 4)
    return q + blocks[0, 0].astype(q.dtype), pool


def kv_write_only(q, k, v, pool, layer, meta, *, sm_scale):
    """The per-layer part of the glue: the new tokens' K/V into the pool (no attention)."""
    from sgjax.kernels.kv_pool import write_kv

    return q, write_kv(pool, layer, k, v, meta.slot_mapping)


def kv_write_pallas_only(q, k, v, pool, layer, meta, *, sm_scale, elements=8192, warps=4, by_head=False):
    """kv_write_only with the Pallas write kernel (kernels/kv_write_gpu.py): `elements` tokens x columns per
    program, `warps` per program, `by_head` its [tokens, heads, head_dim] variant."""
    from sgjax.kernels.kv_write_gpu import pallas_write_kv

    return q, pallas_write_kv(
        pool,
        layer,
        k,
        v,
        meta.slot_mapping,
        interpret=jax.default_backend() == "cpu",
        elements_per_program=elements,
        num_warps=warps,
        by_head=by_head,
    )


def kv_write_unique_only(q, k, v, pool, layer, meta, *, sm_scale):
    """kv_write_only with XLA's scatter told the slots are unique (padding aside)."""
    from sgjax.kernels.kv_pool import interleave_kv

    page_size = pool.shape[2]
    pages, offsets = meta.slot_mapping // page_size, meta.slot_mapping % page_size
    return q, pool.at[layer, pages, offsets].set(interleave_kv(k, v).astype(pool.dtype), unique_indices=True)


def mgpu_only(q, k, v, pool, layer, meta, *, sm_scale):
    """The Mosaic GPU prefill kernel alone: attention over the pool as it is, no KV write."""
    from sgjax.kernels.pallas_mgpu import mgpu_prefill_attention

    return mgpu_prefill_attention(q, pool, layer, meta, sm_scale=sm_scale), pool


def time_dense_baselines(sets, reps):
    """Prefill ceilings on contiguous K/V: cuDNN flash attention and jax's Pallas-Triton mha (dense, MHA)."""
    q, k, v, _ = sets[0]
    out = {}
    cudnn = jax.jit(
        lambda q, k, v: jax.nn.dot_product_attention(q[None], k[None], v[None], is_causal=True, implementation="cudnn")
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu.attention import mha
    group = q.shape[1] // k.shape[1]
    pallas_mha = jax.jit(
        lambda q, k, v: mha(
            q[None], jnp.repeat(k, group, 1)[None], jnp.repeat(v, group, 1)[None], None, sm_scale=D**-0.5, causal=True
        )
    )
    candidates = [("dense_cudnn", cudnn), ("dense_pallas_mha", pallas_mha)]
    try:  # Mosaic GPU (Hopper warpgroups, TMA): the candidate for the new tokens' causal part of a prefill
        from jax.experimental.pallas.ops.gpu import attention_mgpu as mgpu

        for block_kv, steps in ((64, 2), (128, 2), (256, 2), (128, 4)):
            cfg = mgpu.TuningConfig(block_q=64, block_kv=block_kv, max_concurrent_steps=steps, causal=True)
            # its shared-memory tiles are float16 (jax 0.11.2), so it is timed on fp16 copies of the inputs
            candidates.append(
                (
                    f"dense_mgpu_kv{block_kv}_s{steps}_fp16",
                    jax.jit(lambda q, k, v, cfg=cfg: mgpu.attention(*(x[None] for x in (q, k, v)), cfg)),
                )
            )
    except ImportError as e:
        print("attention_mgpu unavailable:", e, flush=True)
    halves = [x.astype(jnp.float16) for x in (q, k, v)]
    for label, f in candidates:
        try:
            args = halves if "fp16" in label else (q, k, v)
            t, _ = _median_time(lambda s: f(*args), None, reps)
            out[label] = t
        except Exception as e:
            print(label, "ERROR", type(e).__name__, str(e)[:200], flush=True)
    return out


def rel_err(out, ref, rows):
    out, ref = np.asarray(out[:rows], np.float32), np.asarray(ref[:rows], np.float32)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def tpu_interpret_check():
    """jax's TPU ragged paged attention through our wrapper in TPU interpret mode (CPU), against `ref`."""
    from jax.experimental.pallas import tpu as pltpu

    from sgjax.kernels.pallas_tpu import pallas_tpu_attention
    from tests.kernels.test_ref_attention import CASES as REF_CASES
    from tests.kernels.test_ref_attention import make_case

    for name in ("mixed", "padded", "prefix-hit-long"):
        args, expected, total = make_case(
            np.random.default_rng(0), num_heads=8, num_kv_heads=2, head_dim=128, **REF_CASES[name]
        )
        with pltpu.force_tpu_interpret_mode():
            out, _ = pallas_tpu_attention(*args, sm_scale=128**-0.5, num_kv_pages_per_block=2, num_queries_per_block=8)
        err = float(np.abs(np.asarray(out)[:total] - expected[:total]).max())
        print(f"tpu-interpret {name}: max abs err {err:.2e}, finite {bool(np.isfinite(np.asarray(out)).all())}")


CASES = {f"decode-{b}x{c // 1024}k": ([1] * b, [c] * b) for b in (1, 32, 128) for c in (1024, 4096, 16384)}
CASES["prefill-4k"] = ([4096], [4096])
CASES["mixed"] = ([1] * 64 + [1024, 1024], [4096] * 64 + [3072, 3072])  # 64 decodes + 2 extends on 2k prefixes
SWEEP = {  # pallas configs tried with --sweep (defaults come from kernels.pallas_gpu.default_config)
    "decode": [
        dict(num_splits=ns, block_k=bk, num_stages=st, prefetch_pages=pf)
        for ns in (1, 2)
        for bk, st, pf in ((128, 2, False), (128, 3, False), (64, 2, True))
    ]
    + [
        dict(num_splits=ns, block_k=bk, num_warps=w, num_stages=st)
        for ns in (1, 2)
        for bk, w, st in ((128, 8, 2), (256, 8, 2), (256, 4, 2), (128, 4, 4), (64, 2, 4))
    ],
    "prefill": [
        dict(block_q=bq, block_k=bk, num_warps=w, num_stages=st, prefetch_pages=pf)
        for bq, bk, w, st, pf in (
            (16, 32, 4, 3, True),
            (16, 64, 4, 3, False),
            (32, 64, 8, 3, False),
            (32, 128, 8, 2, False),
            # M = 256 rows per dot (block_q 64 x G 4), not swept before 2026-11-30
            (64, 32, 8, 3, False),
            (64, 64, 8, 2, False),
            (64, 64, 16, 2, False),
            (64, 128, 8, 2, False),
            (32, 64, 4, 3, False),
            (32, 32, 4, 4, True),
        )
    ],
}

# Mosaic GPU prefill kernel (kernels/pallas_mgpu.py) configurations timed with --mgpu: (block_kv, stages).
MGPU_SWEEP = [(128, 2), (64, 2), (128, 3), (64, 3), (64, 4)]  # (128, 4) needs 297 KB of smem, over 227

# The KV write kernel's (elements per program, warps, by_head) timed per layer with --mgpu; the default is the first.
KV_WRITE_SWEEP = [
    (8192, 4, False),
    (32768, 4, False),
    (8192, 4, True),
    (2048, 4, True),
    (32768, 4, True),
    (32768, 8, True),
    (65536, 8, True),
]

_SHORT = dict(num_splits="ns", block_k="bk", block_q="bq", num_stages="st", num_warps="w", prefetch_pages="pf")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_attention.json")
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES), help="the model's attention shapes")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--sweep", default="", help="comma-separated cases to sweep pallas configs on")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--tpu-interpret", action="store_true", help="only run jax's TPU kernel in interpret mode")
    ap.add_argument("--per-layer", default="", help="comma-separated cases also timed per layer, model-like")
    ap.add_argument("--layers", type=int, default=8, help="layers of the --per-layer pool (one batch, all layers)")
    ap.add_argument(
        "--mgpu",
        action="store_true",
        help="also time the Mosaic GPU prefill kernel (Hopper) on "
        "prefill and mixed cases, its MGPU_SWEEP configurations, and it alone without the KV write",
    )
    args = ap.parse_args()
    global HQ, HKV, D, DTYPE, ITEM
    HQ, HKV, D, DTYPE = SHAPES[args.shape]
    ITEM = jnp.dtype(DTYPE).itemsize
    if args.tpu_interpret:
        return tpu_interpret_check()
    torch_rates = torch_ceilings()
    warm_up()
    jax_bw, jax_mm = copy_bandwidth(), matmul_rate()
    # The fractions use the higher of the two measurements of each ceiling.
    bw = max(jax_bw, torch_rates.get("torch_copy_bytes_per_s", 0.0))
    mm = max(jax_mm, torch_rates.get("torch_matmul_flops_per_s", 0.0))
    print(
        f"device {jax.devices()[0].device_kind}; copy {bw / 1e9:.0f} GB/s (XLA {jax_bw / 1e9:.0f}, "
        f"torch {torch_rates.get('torch_copy_bytes_per_s', 0) / 1e9:.0f}); bf16 matmul {mm / 1e12:.0f} TFLOP/s "
        f"(XLA {jax_mm / 1e12:.0f}, torch {torch_rates.get('torch_matmul_flops_per_s', 0) / 1e12:.0f})",
        flush=True,
    )
    rows = []

    def save(results):
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)

    results = dict(
        copy_bytes_per_s=bw,
        matmul_flops_per_s=mm,
        xla_copy_bytes_per_s=jax_bw,
        xla_matmul_flops_per_s=jax_mm,
        **torch_rates,
        cases=rows,
        jax=jax.__version__,
    )
    for name in args.cases.split(","):
        q_lens, kv_lens = CASES[name]
        pool, sets, io_bytes, flops = build_case(q_lens, kv_lens)
        total = sum(q_lens)
        backends = [("pallas", pallas_attention), ("ref", ref_attention)]
        if name in args.sweep.split(","):
            kind = "prefill" if name.startswith("prefill") else "decode"
            backends += [
                (
                    "pallas " + " ".join(f"{_SHORT[k]}{int(v)}" for k, v in cfg.items()),
                    functools.partial(pallas_attention, **cfg),
                )
                for cfg in SWEEP[kind]
            ]
        if args.mgpu and not name.startswith("decode"):
            backends += [("pallas triton", functools.partial(pallas_attention, prefill_kernel="triton"))]
            backends += [
                (
                    f"mgpu bkv{bkv} st{st}",
                    functools.partial(pallas_attention, prefill_kernel="mgpu", mgpu=dict(block_kv=bkv, stages=st)),
                )
                for bkv, st in MGPU_SWEEP
            ]
            backends += [("mgpu kernel only (no KV write)", mgpu_only)]
        outs = {}
        for label, attend in backends:
            try:
                reps = args.reps if label != "ref" else max(3, args.reps // 5)
                t, pool, out = time_backend(attend, pool, sets, reps)
            except Exception as e:  # a config the Triton lowering rejects is reported, not fatal
                rows.append(dict(case=name, backend=label, error=f"{type(e).__name__}: {str(e)[:300]}"))
                print(name, label, "ERROR", rows[-1]["error"][:200], flush=True)
                continue
            outs[label] = out
            rows.append(
                dict(
                    case=name,
                    backend=label,
                    seconds=t,
                    gbps=io_bytes / t / 1e9,
                    bw_frac=io_bytes / t / bw,
                    tflops=flops / t / 1e12,
                    mm_frac=flops / t / mm,
                )
            )
        if name == "decode-1x16k":
            t, pool, _ = time_backend(glue_only, pool, sets, args.reps)
            rows.append(dict(case=name, backend="glue_only", seconds=t, gbps=0.0, bw_frac=0.0, tflops=0.0, mm_frac=0.0))
        if name.startswith("prefill"):
            for label, t in time_dense_baselines(sets, args.reps).items():
                rows.append(
                    dict(
                        case=name,
                        backend=label,
                        seconds=t,
                        gbps=io_bytes / t / 1e9,
                        bw_frac=io_bytes / t / bw,
                        tflops=flops / t / 1e12,
                        mm_frac=flops / t / mm,
                    )
                )
        if name.startswith("decode") and args.shape == "llama3-8b":  # jax's op: bf16, power-of-two groups
            t, out = time_jax_paged(pool, sets, args.reps)
            outs["jax_paged"] = out
            rows.append(
                dict(
                    case=name,
                    backend="jax_paged",
                    seconds=t,
                    gbps=io_bytes / t / 1e9,
                    bw_frac=io_bytes / t / bw,
                    tflops=flops / t / 1e12,
                    mm_frac=flops / t / mm,
                )
            )
        for r in rows:
            if r["case"] == name and r["backend"] in outs and r["backend"] != "ref":
                r["rel_err_vs_ref"] = rel_err(outs[r["backend"]], outs["ref"], total)
        for r in rows:
            if r["case"] == name and "seconds" in r:
                print(
                    f"{name:14s} {r['backend'][:34]:34s} {r['seconds'] * 1e6:9.1f} us {r['gbps']:7.0f} GB/s "
                    f"({100 * r['bw_frac']:5.1f}%) {r['tflops']:6.1f} TF/s ({100 * r['mm_frac']:5.1f}%) "
                    f"err {r.get('rel_err_vs_ref', 0):.1e}",
                    flush=True,
                )
        del pool, sets
        save(results)
        if name in args.per_layer.split(","):
            pool, sets, _, _ = build_case(q_lens, kv_lens, layers=args.layers, n_rot=1)
            mgpu_rows = (("mgpu kernel only", mgpu_only),) if args.mgpu else ()
            write_rows = (
                [
                    (
                        f"kv_write_pallas e{e} w{w}{' by_head' * bh}",
                        functools.partial(kv_write_pallas_only, elements=e, warps=w, by_head=bh),
                    )
                    for e, w, bh in KV_WRITE_SWEEP
                ]
                if args.mgpu
                else [("kv_write_pallas", kv_write_pallas_only)]
            )
            for label, attend in (
                ("pallas", pallas_attention),
                ("pallas triton", functools.partial(pallas_attention, prefill_kernel="triton")),
                *mgpu_rows,
                ("kv_write_only", kv_write_only),
                *write_rows,
                ("kv_write_unique", kv_write_unique_only),
            ):
                t, pool, _ = time_per_layer(attend, pool, sets[0], args.reps)
                # a write alone moves the new tokens' K/V twice (read, then written into pages); no FLOPs
                moved, done = (
                    (4 * sum(q_lens) * HKV * D * ITEM, 0) if label.startswith("kv_write") else (io_bytes, flops)
                )
                rows.append(
                    dict(
                        case=name,
                        backend=f"{label} per layer ({args.layers} layers, one batch)",
                        seconds=t,
                        gbps=moved / t / 1e9,
                        bw_frac=moved / t / bw,
                        tflops=done / t / 1e12,
                        mm_frac=done / t / mm,
                    )
                )
                r = rows[-1]
                print(
                    f"{name:14s} {r['backend'][:34]:34s} {t * 1e6:9.1f} us {r['gbps']:7.0f} GB/s "
                    f"({100 * r['bw_frac']:5.1f}%) {r['tflops']:6.1f} TF/s ({100 * r['mm_frac']:5.1f}%)",
                    flush=True,
                )
                save(results)  # a run cut by its time limit keeps every row measured so far
            del pool, sets


if __name__ == "__main__":
    main()
