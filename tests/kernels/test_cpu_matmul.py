"""The CPU's matrix products (kernels/cpu_matmul.cc through XLA's FFI) against numpy, on every code path: the
widening FMA loops (AVX-512, AVX2, plain C++), and, where this CPU has them and K is a multiple of 64, the bf16
dot-product (vdpbf16ps: x rounded to bf16) and int8 / int4 dot-product (vpdpbusd: x quantized per block of 64) paths,
int8 with a scale per row or per 32 (Q8_0's blocks);
stacked layers read in place, several matrices in one call, x's row counts around the 4-row passes; the spinning
helpers under concurrent calls; and the refusals."""

import concurrent.futures
import os
import platform
import subprocess
import sys

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgjax.kernels import cpu
from sgjax.model.quant import (Int4Matrix, Int8Matrix, dequantized, int4_from_q4_0, int8_from_q8_0, quantize,
                               quantize_int4)

ARCHS = ["native"] + (["x86-64-v3", "x86-64"] if platform.machine() in ("x86_64", "AMD64") else [])


def _dot_path(arch: str, flag: str, k: int) -> bool:
    return arch == "native" and flag in cpu.cpu_flags() and k % 64 == 0


def _round_bf16(x):
    return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))


def _quantized_x(x):
    """kernels/cpu_matmul.cc's QuantizeBlocks in numpy: per block of 64, scale = max |x| / 127, q = round(x / scale)
    (x times the float32 inverse, to nearest even)."""
    rows, k = x.shape
    blocks = x.reshape(rows, k // 64, 64)
    scale = (np.abs(blocks).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.where(scale > 0, np.float32(1) / np.where(scale > 0, scale, 1), 0).astype(np.float32)
    q = np.rint(blocks * inv[..., None]).astype(np.float32)
    return q, scale


def _expected(x, w, scale, arch, amx=None):
    """x @ w^T (* scale) as the path `arch` takes computes it (amx: whether the kernel may use AMX tiles; None:
    where the CPU has them), in float64."""
    k = x.shape[1]
    amx = cpu.has_amx() if amx is None else amx
    if w.dtype == jnp.bfloat16:
        x = _round_bf16(x) if _dot_path(arch, "avx512_bf16", k) else x
        return x.astype(np.float64) @ np.asarray(w.astype(jnp.float32), np.float64).T
    tiles = arch == "native" and amx and k % 64 == 0 and x.shape[0] > 4  # int8 / int4 on AMX tiles
    if isinstance(w, (Int4Matrix, Int8Matrix)):  # grouped: the widened weights (each times its group's scale)
        wide = np.asarray(dequantized(w), np.float64)
        if tiles:  # x and the widened weights rounded to bf16
            return _round_bf16(x).astype(np.float64) @ _round_bf16(wide).astype(np.float64).T
        if _dot_path(arch, "avx512_vnni", k):
            q, xs = _quantized_x(x)
            per_block = np.einsum("mbk,nbk->mnb", q.astype(np.float64), wide.reshape(w.q.shape[0], k // 64, 64))
            return (per_block * xs[:, None, :]).sum(-1)
        return x.astype(np.float64) @ wide.T
    if w.dtype == np.int8 and tiles:  # the weights exact in bf16, x rounded to it
        return _round_bf16(x).astype(np.float64) @ np.asarray(w, np.float64).T * np.asarray(scale, np.float64)
    if w.dtype == np.int8 and _dot_path(arch, "avx512_vnni", k):
        q, xs = _quantized_x(x)
        w64 = np.asarray(w, np.float64).reshape(w.shape[0], k // 64, 64)
        per_block = np.einsum("mbk,nbk->mnb", q.astype(np.float64), w64)
        return (per_block * xs[:, None, :]).sum(-1) * np.asarray(scale, np.float64)
    out = x.astype(np.float64) @ np.asarray(w, np.float64).T
    return out if scale is None else out * np.asarray(scale, np.float64)


def _matrices(rng, kind, n, k, layers=0):
    shape = ((layers,) if layers else ()) + (n, k)
    w = rng.standard_normal(shape).astype(np.float32) * 0.1
    if kind == "int8":
        m = quantize(w)
        return m.q, m.scale
    if kind == "int4":
        m = quantize_int4(w)
        return m.q, m.scale
    if kind == "int8g":  # a GGUF Q8_0 tensor's blocks, as the loader keeps them
        m = int8_from_q8_0(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0))
        return m.q, m.scale
    if kind == "int4q0":  # a Q4_0 tensor's: negative steps, low = -8 step
        m = int4_from_q4_0(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0))
        return m.q, m.scale
    return (w if kind == "float32" else jnp.asarray(w, jnp.bfloat16)), None


def _reference(kind, w, scale):
    """(weights, scale) as _expected takes them: int4 and grouped int8 as their matrices (scales inside)."""
    if kind in ("int4", "int8g", "int4q0"):
        return (Int8Matrix if kind == "int8g" else Int4Matrix)(np.asarray(w), np.asarray(scale)), None
    return (np.asarray(w) if kind == "int8" else w), scale


# K: multiples of 64; of 16 only; a scalar tail (int4 rows are runs of 64 weights, model/quant.BLOCK; grouped int8
# rows groups of 32: 96 takes the widening loop)
KINDS = [(kind, k) for kind in ("float32", "bfloat16", "int8", "int4") for k in (576, 128, 80, 37)
         if kind != "int4" or k % 64 == 0] + [("int8g", k) for k in (576, 128, 96)] + [("int4q0", 576)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind,k", KINDS)
def test_matches_numpy_on_every_path(arch, kind, k):
    rng = np.random.default_rng(k)
    # x's passes of 3, 4 + 2 and 4 + 4 + 1 rows (int8 / int4 past 4 rows on AMX tiles where the CPU has them; 17:
    # two chunks of x, and 37 output rows: 32 in tiles, 5 on the vector loop)
    for rows in (3, 6, 9, 17):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        w, scale = _matrices(rng, kind, 37, k)
        (out,) = cpu.cpu_matmul(jnp.asarray(x), 0, [(jnp.asarray(w), scale)], arch=arch)
        expected = _expected(x, *_reference(kind, w, scale), arch)
        np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-4, atol=1e-4 * np.sqrt(k))


@pytest.mark.parametrize("kind", ["bfloat16", "int8", "int4", "int8g"])
@pytest.mark.parametrize("amx", [True, False], ids=["amx", "vector"])
def test_tiles_and_vector_loop(amx, kind):
    """Products on the matrix unit (AMX tiles, where the CPU has them: bf16 at any row count, int8 / int4 widened
    past 4 rows; x rows in chunks of 16, output rows in fours and ones of 16 tiles, a bf16 matrix's last few on the
    vector loop) and on the vector loops, against numpy: row counts across the chunks, widths across the tiles."""
    rng = np.random.default_rng(5)
    with cpu.use_amx(amx) as there:
        assert there == cpu.has_amx()
        for n, k in ((37, 576), (200, 128), (64, 1536)):
            w, scale = _matrices(rng, kind, n, k)
            ref, ref_scale = _reference(kind, w, scale)
            for rows in (1, 5, 16, 17, 40):
                x = rng.standard_normal((rows, k)).astype(np.float32)
                (out,) = jax.jit(lambda x, w, s: cpu.cpu_matmul(x, 0, [(w, s)]))(jnp.asarray(x), jnp.asarray(w), scale)
                expected = _expected(x, ref, ref_scale, "native", amx=there and amx)
                np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-4, atol=1e-4 * np.sqrt(k) * np.abs(
                    expected).max() / 3)


@pytest.mark.parametrize("kind", ["bfloat16", "int8", "int4", "int8g"])
def test_stacked_layers_in_place_and_several_matrices_per_call(kind):
    """[L, N, K] matrices with a traced layer index (clamped into range), three matrices of different widths in one
    call (q, k and v), inside a scan as the forward runs them; and each layer as its own buffer, picked the same."""
    rng = np.random.default_rng(7)
    k, layers = 128, 3
    mats = [_matrices(rng, kind, n, k, layers) for n in (64, 16, 16)]
    x = jnp.asarray(rng.standard_normal((2, k)), jnp.float32)

    def body(carry, index):
        return carry, cpu.cpu_matmul(x, index, [(jnp.asarray(w), s) for w, s in mats])

    _, outs = jax.jit(lambda: jax.lax.scan(body, 0, jnp.arange(layers, dtype=jnp.int32)))()
    for i in range(layers):
        for (w, s), out in zip(mats, outs):
            np.testing.assert_allclose(np.asarray(out[i]), _expected(
                np.asarray(x), *_reference(kind, w[i], None if s is None else s[i]), "native"), rtol=1e-4, atol=2e-3)
    (past,) = cpu.cpu_matmul(x, 99, [(jnp.asarray(mats[0][0]), mats[0][1])])  # clamped to the last layer
    np.testing.assert_array_equal(np.asarray(past), np.asarray(outs[0][-1]))

    # The same layers as separate [N, K] buffers, a list per matrix (model/llama.LayerPick): the same numbers.
    groups = [[(jnp.asarray(w[i]), None if s is None else s[i]) for i in range(layers)] for w, s in mats]
    _, grouped = jax.jit(lambda: jax.lax.scan(lambda c, i: (c, cpu.cpu_matmul(x, i, groups)), 0,
                                              jnp.arange(layers, dtype=jnp.int32)))()
    for a, b in zip(grouped, outs):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="same number of layers"):
        cpu.cpu_matmul(x, 0, [groups[0], groups[1][:2]])


def test_concurrent_calls_from_threads_share_the_helpers():
    """Calls from several Python threads at once (two engines' steps): one job holds the helpers, the others run
    on their own threads; every result is right."""
    rng = np.random.default_rng(3)
    w, scale = _matrices(rng, "int8", 256, 576)
    f = jax.jit(lambda x: cpu.cpu_matmul(x, 0, [(jnp.asarray(w), scale)])[0])
    xs = [jnp.asarray(rng.standard_normal((1 + i % 5, 576)), jnp.float32) for i in range(24)]
    expected = [np.asarray(f(x)) for x in xs]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda x: np.asarray(f(x)), xs * 3))
    for out, want in zip(outs, expected * 3):
        np.testing.assert_array_equal(out, want)


def test_one_thread_setting_gives_the_same_numbers(tmp_path):
    """SGJAX_CPU_THREADS=1 (no helpers: a process sharing its cores) computes what the helpers do, in a child."""
    rng = np.random.default_rng(11)
    w, scale = _matrices(rng, "int8", 512, 576)
    x = rng.standard_normal((3, 576)).astype(np.float32)
    np.savez(tmp_path / "in.npz", w=w, scale=scale, x=x)
    code = ("import numpy as np, jax.numpy as jnp; from sgjax.kernels import cpu; d = np.load('in.npz'); "
            "np.save('out.npy', np.asarray(cpu.cpu_matmul(jnp.asarray(d['x']), 0, "
            "[(jnp.asarray(d['w']), jnp.asarray(d['scale']))])[0]))")
    env = {**os.environ, "SGJAX_CPU_THREADS": "1", "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, check=True, timeout=300)
    (here,) = cpu.cpu_matmul(jnp.asarray(x), 0, [(jnp.asarray(w), scale)])
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), np.asarray(here))


def test_refusals_name_the_operand():
    x = jnp.ones((2, 64), jnp.float32)
    with pytest.raises(Exception, match="int8 weights need a float32 scale"):
        jax.block_until_ready(cpu.cpu_matmul(x, 0, [(jnp.ones((8, 64), jnp.int8), None)]))
    with pytest.raises(Exception, match="x's K"):
        jax.block_until_ready(cpu.cpu_matmul(x, 0, [(jnp.ones((8, 32), jnp.float32), None)]))
    with pytest.raises(Exception, match="float32, bfloat16, int8 or packed int4"):
        jax.block_until_ready(cpu.cpu_matmul(x, 0, [(jnp.ones((8, 64), jnp.float16), None)]))
    with pytest.raises(Exception, match=r"int4 weights need float32 \(scale, low\) pairs"):
        jax.block_until_ready(cpu.cpu_matmul(x, 0, [(jnp.ones((8, 32), jnp.uint8), jnp.ones((8,), jnp.float32))]))


def test_quantize_rows():
    """Per output row: scale = max |row| / 127, |w - q * scale| <= scale / 2, a row of zeros kept exact; numpy
    and jax alike; rows() looks embeddings up widened."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 5, 40)).astype(np.float32)
    w[1, 2] = 0.0
    for m in (quantize(w), quantize(jnp.asarray(w))):
        assert isinstance(m, Int8Matrix) and m.q.dtype == np.int8 and m.scale.shape == (3, 5)
        np.testing.assert_allclose(np.asarray(m.scale), np.abs(w).max(-1) / 127 + (w == 0).all(-1), rtol=1e-6)
        err = np.abs(np.asarray(dequantized(m)) - w)
        assert (err <= np.asarray(m.scale)[..., None] / 2 + 1e-6).all()
        assert not np.asarray(m.q)[1, 2].any() and np.abs(np.asarray(m.q)).max() == 127
    flat = quantize(w[0])
    np.testing.assert_allclose(np.asarray(flat.rows(jnp.asarray([4, 0]))), np.asarray(dequantized(flat))[[4, 0]])


def test_int8_from_q8_0_blocks():
    """A GGUF Q8_0 tensor read as a grouped Int8Matrix (the loader's keep_blocks) holds gguf's own dequantized
    weights exactly: q as stored, a float32 scale per 32 weights of a row; rows() looks embeddings up widened."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((2, 3, 96)).astype(np.float32)
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    m = int8_from_q8_0(blocks)
    assert m.q.dtype == np.int8 and m.q.shape == (2, 3, 96) and m.scale.shape == (2, 3, 3) and m.grouped
    assert not quantize(w).grouped
    want = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(np.asarray(dequantized(m)), want)
    np.testing.assert_array_equal(np.asarray(Int8Matrix(m.q[0], m.scale[0]).rows(jnp.asarray([2, 0]))), want[0][[2, 0]])
    with pytest.raises(ValueError, match="34-byte blocks"):
        int8_from_q8_0(blocks[..., :-1])


def test_int4_from_q4_0_blocks():
    """A GGUF Q4_0 tensor (a step d per 32 weights, each d * (u - 8), d of either sign) read as an Int4Matrix holds
    gguf's own dequantized weights exactly; rows of an odd number of blocks are refused (int4's runs are two)."""
    rng = np.random.default_rng(4)
    w = rng.standard_normal((2, 3, 128)).astype(np.float32)
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0)
    m = int4_from_q4_0(blocks)
    assert m.q.shape == (2, 3, 64) and m.scale.shape == (2, 3, 4, 2) and (np.asarray(m.scale)[..., 0] < 0).any()
    want = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_0)
    np.testing.assert_array_equal(np.asarray(dequantized(m)), want)
    with pytest.raises(ValueError, match="even number of 18-byte blocks"):
        int4_from_q4_0(blocks[..., :54])


def test_quantize_int4_groups():
    """Per group of 32 along a row: low = min, scale = (max - min) / 15, |w - widened| <= scale / 2, steps in
    [0, 15] packed two a byte (low nibbles a run's first 32 weights); numpy and jax alike; rows of other lengths
    refused."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((2, 3, 128)).astype(np.float32)
    w[0, 1, :32] = 0.5
    for m in (quantize_int4(w), quantize_int4(jnp.asarray(w))):
        assert isinstance(m, Int4Matrix) and m.q.dtype == np.uint8 and m.q.shape == (2, 3, 64)
        assert m.shape == (2, 3, 128) and m.scale.shape == (2, 3, 4, 2)
        groups = w.reshape(2, 3, 4, 32)
        spread = groups.max(-1) - groups.min(-1)
        scale, low = np.asarray(m.scale)[..., 0], np.asarray(m.scale)[..., 1]
        np.testing.assert_allclose(scale, np.where(spread > 0, spread / 15, 1), rtol=1e-6)
        np.testing.assert_array_equal(low, groups.min(-1))
        err = np.abs(np.asarray(dequantized(m)) - w).reshape(2, 3, 4, 32)
        assert (err <= scale[..., None] / 2 + 1e-6).all()
        assert err[0, 1, 0].max() == 0  # a constant group is exact
        steps = np.asarray(m.q)[0, 0, :32] & 0xF  # weights 0..31 of the first run
        np.testing.assert_array_equal(steps, np.clip(np.round((w[0, 0, :32] - low[0, 0, 0]) / scale[0, 0, 0]), 0, 15))
    np.testing.assert_allclose(np.asarray(quantize_int4(w[0]).rows(jnp.asarray([2]))),
                               np.asarray(dequantized(quantize_int4(w[0])))[[2]])
    with pytest.raises(ValueError, match="multiple of 64"):
        quantize_int4(w[..., :96])
