"""The `cpu` backend (kernels/cpu_attention.cc through XLA's FFI) against the per-request numpy attention of
test_ref_attention, on the contract cases and the shapes its vector paths take (head_dim a multiple of 16 or not,
pages of 16 or not, blocks of several rows, bfloat16 pools), fp8 pools (every code read, writes bit-identical to the
jax writer's), and its build: cached, and refused by name."""

import functools
import os
import platform
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgjax.kernels import AttentionMetadata, allocate_pool, cpu, default_backend, get_backend
from sgjax.kernels.kv_pool import write_kv
from tests.kernels.test_ref_attention import CASES, WINDOWED, make_case, windowed_args

HEADS = {"mha": (4, 4), "gqa4": (8, 2), "gqa8": (8, 1), "gqa3": (9, 3)}
# The vector paths: pages of 16 with head_dim 64 (the tiles and the 64-wide value accumulators), head_dim 80 (a
# 16-wide tail), 20 rows of one request (a full block of 16, then 4), decode rows beside a long prefill.
EXTRA = {
    "page16-d64": dict(q_lens=[1, 20, 1], prefix_lens=[40, 13, 0], page_size=16, head_dim=64),
    "page16-d80": dict(q_lens=[3, 1], prefix_lens=[50, 33], page_size=16, head_dim=80),
    "long-decode": dict(
        q_lens=[1, 1, 1, 1, 1], prefix_lens=[300, 17, 160, 64, 1], page_size=16, head_dim=64, num_tokens=7
    ),
    # decode rows at head_dim 128 and 256 (the row kernel's wider accumulators), one row a page's first key
    "decode-d128": dict(q_lens=[1, 1, 1], prefix_lens=[40, 200, 16], page_size=16, head_dim=128),
    "decode-d256": dict(q_lens=[1, 1], prefix_lens=[70, 31], page_size=16, head_dim=256),
}
# Windows on pages of 16: a row's first page is partial, its first key mid-page (the rows kernel's mask), in a
# decode row and in a prefill block's rows; with a softcap the rows take the general path.
WINDOWED16 = {
    "window-page16-decode": dict(EXTRA["long-decode"], window=37),
    "window-page16-d128": dict(EXTRA["decode-d128"], window=50),
    "window-page16-softcap": dict(EXTRA["long-decode"], window=20, softcap=2.0),
    "window-page16-prefill": dict(EXTRA["page16-d64"], window=7),  # a block's rows each with their own first key
}


# The kernel's code paths: AVX-512 where this machine has it (native), AVX2 + FMA, and plain C++ (x86 builds).
ARCHS = ["native"] + (["x86-64-v3", "x86-64"] if platform.machine() in ("x86_64", "AMD64") else [])


def _run(args, pool=None, **kwargs):
    q, k, v, pool0, layer, meta = args
    attend = jax.jit(functools.partial(cpu.cpu_attention, sm_scale=q.shape[-1] ** -0.5, **kwargs))
    out, new_pool = attend(q, k, v, pool0 if pool is None else pool, layer, meta)
    return np.asarray(out), np.asarray(new_pool)


@pytest.mark.parametrize("case", sorted({**CASES, **EXTRA}))
@pytest.mark.parametrize("heads", sorted(HEADS))
def test_matches_per_request_attention(case, heads):
    num_heads, num_kv_heads = HEADS[heads]
    rng = np.random.default_rng(sum(map(ord, case + heads)))
    args, expected, total = make_case(rng, num_heads=num_heads, num_kv_heads=num_kv_heads, **{**CASES, **EXTRA}[case])
    out, new_pool = _run(args)
    for arch in ARCHS[1:]:  # the same numbers from the AVX2 and plain builds
        np.testing.assert_allclose(_run(args, arch=arch)[0][:total], expected[:total], atol=3e-5, rtol=2e-5)
    np.testing.assert_allclose(out[:total], expected[:total], atol=3e-5, rtol=2e-5)
    assert np.isfinite(out).all() and not out[total:].any()  # padded rows give zeros
    q, k, v, pool, layer, meta = args
    flat = new_pool[layer].reshape(-1, 2 * num_kv_heads, q.shape[-1])
    slots = np.asarray(meta.slot_mapping)[:total]
    np.testing.assert_array_equal(flat[slots, 0::2], np.asarray(k)[:total])
    np.testing.assert_array_equal(flat[slots, 1::2], np.asarray(v)[:total])


@pytest.mark.parametrize("case", sorted({**WINDOWED, **WINDOWED16}))
@pytest.mark.parametrize("traced", [False, True], ids=["static", "traced"])
def test_sliding_window_and_softcap(case, traced):
    spec = {**WINDOWED, **WINDOWED16}[case]
    rng = np.random.default_rng(sorted({**WINDOWED, **WINDOWED16}).index(case))
    args, expected, total = make_case(rng, num_heads=8, num_kv_heads=2, **spec)
    _, extra = windowed_args(spec)
    q, k, v, pool, layer, meta = args

    def attend(q, k, v, pool, meta, window):  # traced: the window a scanned layer loop gives (one per layer)
        return cpu.cpu_attention(
            q, k, v, pool, layer, meta, sm_scale=q.shape[-1] ** -0.5, window=window, softcap=extra["softcap"]
        )

    if traced:
        out, _ = jax.jit(attend)(q, k, v, pool, meta, jnp.int32(extra["window"]))
    else:
        out, _ = jax.jit(functools.partial(attend, window=extra["window"]))(q, k, v, pool, meta)
    np.testing.assert_allclose(np.asarray(out)[:total], expected[:total], atol=3e-5, rtol=2e-5)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", ["mixed", "page16-d64", "long-decode", "decode-d128"])
def test_bfloat16_pool_reads_as_float32(case, arch):
    """A bfloat16 pool: the kernel widens each key and value; the same as the float32 kernel on the rounded pool."""
    args, _, total = make_case(np.random.default_rng(3), num_heads=8, num_kv_heads=2, **{**CASES, **EXTRA}[case])
    q, k, v, pool, layer, meta = args
    rounded = pool.astype(jnp.bfloat16)
    out16, pool16 = _run((q, k, v, rounded, layer, meta), arch=arch)
    out32, _ = _run(
        (
            q,
            k.astype(jnp.bfloat16).astype(jnp.float32),
            v.astype(jnp.bfloat16).astype(jnp.float32),
            rounded.astype(jnp.float32),
            layer,
            meta,
        ),
        arch=arch,
    )
    assert pool16.dtype == jnp.bfloat16
    np.testing.assert_allclose(out16[:total], out32[:total], atol=1e-5, rtol=1e-5)
    # the kernel writes the new keys and values itself, rounded as XLA's convert rounds (to nearest even)
    flat = np.asarray(pool16[layer].reshape(-1, pool.shape[-2], q.shape[-1]).view(np.uint16))
    slots = np.asarray(meta.slot_mapping)[:total]
    np.testing.assert_array_equal(flat[slots, 0::2], np.asarray(k.astype(jnp.bfloat16)).view(np.uint16)[:total])
    np.testing.assert_array_equal(flat[slots, 1::2], np.asarray(v.astype(jnp.bfloat16)).view(np.uint16)[:total])


def test_out_of_range_pages_are_clamped_not_read_past_the_pool():
    """A page table entry past the pool (a bug upstream) must not read outside it: the kernel clamps page ids."""
    args, _, total = make_case(np.random.default_rng(5), num_heads=4, num_kv_heads=4, **CASES["all-decode"])
    q, k, v, pool, layer, meta = args
    bad = meta.page_table.at[0, 0].set(10**6).at[1, 0].set(-5)
    out, _ = _run((q, k, v, pool, layer, type(meta)(meta.slot_mapping, meta.cu_q_lens, meta.kv_lens, bad)))
    assert np.isfinite(out).all()


def test_the_cpu_default_and_its_cached_build(tmp_path, monkeypatch):
    """The CPU's default backend is the native kernel; its library is built once per source, flags and machine
    (a second lookup finds the file), and a missing compiler is refused by name."""
    assert default_backend("cpu") == "cpu" and get_backend("cpu") is cpu.cpu_attention
    assert default_backend("gpu") == "pallas"
    path = cpu.library_path()
    assert path.startswith(cpu.cache_dir()) and path.endswith(".so")
    monkeypatch.setenv("SGJAX_CACHE_DIR", str(tmp_path))
    cpu.library_path.cache_clear()
    try:
        built = cpu.library_path()
        assert built.startswith(str(tmp_path))
        mtime = os.path.getmtime(built)
        cpu.library_path.cache_clear()
        assert cpu.library_path() == built and os.path.getmtime(built) == mtime
        (tmp_path / "a-file").write_text("")  # a cache that cannot be made (even by root): the temp dir holds it
        monkeypatch.setenv("SGJAX_CACHE_DIR", str(tmp_path / "a-file" / "cache"))
        cpu.library_path.cache_clear()
        assert cpu.library_path().startswith(os.path.join(tempfile.gettempdir(), "sgjax-kernels"))
        monkeypatch.setenv("CXX", "no-such-compiler-here")
        cpu.library_path.cache_clear()
        with pytest.raises(cpu.NativeBuildError, match="no C\\+\\+ compiler"):
            cpu.library_path()
    finally:
        cpu.library_path.cache_clear()
    monkeypatch.setattr(cpu, "available", lambda: False)  # no native kernel here: the CPU serves with ref
    assert default_backend("cpu") == "ref"


FP8 = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}


def fp8_encoder_inputs(dtype) -> np.ndarray:
    """float32 values where an fp8 encoder goes wrong: every finite fp8 value, the ties halfway between neighbours
    (round to even), each one ulp either side, past the largest value (saturation, the e4m3fn tie 464 a plain
    convert makes NaN), under the smallest subnormal (half of it ties to zero), float32's subnormals, infinities,
    NaNs of both signs and many payloads, and random bit patterns over the whole float32 range."""
    rng = np.random.default_rng(0)
    values = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)
    finite = np.unique(values[np.isfinite(values)])
    big, tiny = float(finite.max()), float(finite[finite > 0].min())
    ties = (finite[:-1] + finite[1:]) / 2  # exact in float32: fp8 neighbours differ by a power of two
    edges = np.float32([big * 1.0 + big / 16, big * 2, 1e30, np.inf, tiny / 2, tiny / 4, tiny * 0.75, 0.0])
    near = np.concatenate([finite, ties, edges])
    near = np.concatenate([near, np.nextafter(near, np.float32(np.inf)), np.nextafter(near, np.float32(-np.inf))])
    # magnitudes over the format's exponents and a few past either end, random float32 mantissas
    span = rng.uniform(np.log2(tiny) - 4, np.log2(big) + 2, 1 << 20)
    scaled = (np.exp2(np.floor(span)) * rng.uniform(1, 2, span.size)).astype(np.float32)
    bits = rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    subnormal32 = rng.integers(1, 1 << 23, 4096, dtype=np.uint32)
    nans = (0x7F800000 | rng.integers(1, 1 << 23, 1024, dtype=np.uint32)).view(np.float32)
    both = np.concatenate([near, scaled, subnormal32.view(np.float32), nans])
    return np.concatenate([both, -both, bits.view(np.float32)])


def _write_rows(values, dtype, arch=None):
    """`values` as the new keys and values of padded rows (written, attending nothing) into an fp8 pool of head_dim
    256 and 4 KV heads, by the cpu kernel (arch) or by the jax writer (None); the pool's bytes."""
    heads, d, ps = 4, 256, 16
    width = 2 * heads * d
    rows = -(-values.size // width)
    kv = np.zeros(rows * width, np.float32)
    kv[: values.size] = values
    k, v = (jnp.asarray(x.reshape(rows, heads, d)) for x in np.split(kv.reshape(rows, width), 2, axis=1))
    pool = allocate_pool(2, 1 + rows // ps + 1, ps, heads, d, dtype)
    slots = jnp.arange(ps, ps + rows, dtype=jnp.int32)  # page 1 on: page 0 is the null page
    if arch is None:
        new = jax.jit(write_kv)(pool, jnp.int32(1), k, v, slots)
    else:
        meta = AttentionMetadata(slots, jnp.zeros(2, jnp.int32), jnp.zeros(1, jnp.int32), jnp.zeros((1, 1), jnp.int32))
        q = jnp.zeros((rows, heads, d), jnp.float32)
        _, new = jax.jit(functools.partial(cpu.cpu_attention, sm_scale=1.0, arch=arch))(q, k, v, pool, 1, meta)
    return np.asarray(new).view(np.uint8).reshape(-1)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fmt", sorted(FP8))
def test_fp8_pool_writes_are_bit_identical_to_the_jax_writer(fmt, arch):
    """The kernel encodes the new keys and values itself: byte for byte what kv_pool.write_kv stores (saturation,
    round to nearest even, NaN and signed zeros), over two million float32 values."""
    values = fp8_encoder_inputs(FP8[fmt])
    want, got = _write_rows(values, FP8[fmt]), _write_rows(values, FP8[fmt], arch)
    bad = np.flatnonzero(want != got)
    assert bad.size == 0, f"{bad.size} bytes differ, e.g. {want[bad[:8]]} written as {got[bad[:8]]}"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fmt", sorted(FP8))
def test_fp8_pool_reads_every_code(fmt, arch):
    """Each request sees one cached key (no write: its slot is outside the pool), so its output is that slot's
    values exactly: the 256 codes of the format, infinities and NaNs among them, read through the kernel's table."""
    reqs, ps, d = 4, 16, 64
    codes = np.arange(256, dtype=np.uint8).reshape(reqs, d)
    pool = np.zeros((2, 1 + reqs, ps, 2, d), np.uint8)
    pool[1, 1:, 0, 1] = codes  # V of slot 0 on page 1 + r; the keys are zeros
    meta = AttentionMetadata(
        slot_mapping=jnp.full(reqs, -1, jnp.int32),
        cu_q_lens=jnp.arange(reqs + 1, dtype=jnp.int32),
        kv_lens=jnp.ones(reqs, jnp.int32),
        page_table=jnp.arange(1, reqs + 1, dtype=jnp.int32)[:, None],
    )
    q, kv = jnp.ones((reqs, 2, d), jnp.float32), jnp.zeros((reqs, 1, d), jnp.float32)
    attend = jax.jit(functools.partial(cpu.cpu_attention, sm_scale=1.0, arch=arch))
    out, _ = attend(q, kv, kv, jnp.asarray(pool.view(FP8[fmt])), 1, meta)
    want = codes.view(FP8[fmt]).astype(np.float32)
    for head in range(2):  # both query heads read the one KV head
        np.testing.assert_array_equal(np.asarray(out)[:, head], want)
