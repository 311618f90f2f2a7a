"""The `cpu` backend (kernels/cpu_attention.cc through XLA's FFI) against the per-request numpy attention of
test_ref_attention, on the contract cases and the shapes its vector paths take (head_dim a multiple of 16 or not,
pages of 16 or not, blocks of several rows, bfloat16 pools), and its build: cached, and refused by name."""

import functools
import os
import platform
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgjax.kernels import cpu, default_backend, get_backend
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
