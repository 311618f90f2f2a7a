"""The CPU's matrix products (kernels/cpu_matmul.cc through XLA's FFI, weights packed by kernels/cpu_pack.py) against
numpy, for every weight kind (float32, bfloat16, int8 with a scale per row or per 32 as Q8_0's, int4 as Q4_1's and
Q4_0's): one arithmetic whatever the row count (bit for bit: batch invariance), the scalar build's integer and float32
paths equal to the vector build's bit for bit, stacked layers read in place, several matrices per call, the helper
threads, the refusals; then the quantizers that feed it."""

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
from sgjax.kernels.cpu_pack import PackedMatrix, pack_float, pack_int4, pack_int8
from sgjax.model.quant import (
    Int4Matrix,
    Int8Matrix,
    dequantized,
    int4_from_q4_0,
    int8_from_q8_0,
    quantize,
    quantize_int4,
)

SCALAR = "x86-64" if platform.machine() in ("x86_64", "AMD64") else None  # the build without vectors
KINDS = ["float32", "bfloat16", "int8", "int8g", "int4", "int4q0"]


def _matrix(rng, kind, n, k, layers=0):
    """(the packed matrix, its quantized or float weights [.., n, k] as the kernel multiplies by them)."""
    shape = ((layers,) if layers else ()) + (n, k)
    w = rng.standard_normal(shape).astype(np.float32) * 0.1
    if kind == "float32":
        return pack_float(w), w
    if kind == "bfloat16":
        wb = np.asarray(jnp.asarray(w, jnp.bfloat16))
        return pack_float(wb), wb
    m = {
        "int8": lambda: quantize(w),
        "int8g": lambda: int8_from_q8_0(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)),
        "int4": lambda: quantize_int4(w),
        "int4q0": lambda: int4_from_q4_0(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0)),
    }[kind]()
    return (pack_int8 if isinstance(m, Int8Matrix) else pack_int4)(m.q, m.scale), m


def _quantized_x(x):
    """kernels/cpu_matmul.cc's QuantizeRow in numpy: per group of 32, s = max |x| / 127, q = rint(x * (1 / s))."""
    groups = x.reshape(x.shape[0], -1, 32)
    s = (np.abs(groups).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.where(s > 0, np.float32(1) / np.where(s > 0, s, 1), 0).astype(np.float32)
    q = np.clip(np.rint((groups * inv[..., None]).astype(np.float32)), -128, 127)
    return q, s, (s * q.sum(-1)).astype(np.float32)


def _expected(x, w):
    """x @ w^T as the kernel computes it, in float64: integer kinds as exact sums per group of 32 of x's int8
    steps and the weights' steps, then each group's scale and low; bf16 with x rounded to bf16."""
    if isinstance(w, np.ndarray):
        if w.dtype != np.float32:  # bf16
            x = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
        return x.astype(np.float64) @ np.asarray(w, np.float64).T
    q, xs, xsum = (a.astype(np.float64) for a in _quantized_x(x))
    n, k = w.shape
    if isinstance(w, Int4Matrix):
        runs = np.asarray(w.q).reshape(n, k // 64, 32)
        u = np.concatenate([runs & 0xF, runs >> 4], -1).reshape(n, k // 32, 32).astype(np.float64)
        scale, low = (np.asarray(w.scale, np.float64)[..., i] for i in (0, 1))
    else:
        u = (np.asarray(w.q, np.float64) + 128).reshape(n, k // 32, 32)
        scale = np.asarray(w.scale, np.float64)
        scale = scale if scale.ndim == 2 else np.repeat(scale[:, None], k // 32, 1)
        low = -128 * scale
    isum = np.einsum("mgk,ngk->mng", q, u)
    return (isum * scale[None] * xs[:, None] + low[None] * xsum[:, None]).sum(-1)


def _run(x, mats, arch="native", layer=0):
    return [np.asarray(o) for o in jax.jit(lambda x: cpu.cpu_matmul(x, layer, mats, arch=arch))(jnp.asarray(x))]


# K per kind: int4's runs of 64, integer groups of 32 (96: an odd number of groups), float's any (37: a tail)
K = {
    "float32": (576, 96, 37),
    "bfloat16": (576, 96, 38),
    "int8": (576, 96),
    "int8g": (576, 96),
    "int4": (576, 128),
    "int4q0": (576,),
}


@pytest.mark.parametrize("arch", ["native"] + ([SCALAR] if SCALAR else []))
@pytest.mark.parametrize("kind", KINDS)
def test_matches_numpy(arch, kind):
    rng = np.random.default_rng(7)
    for k in K[kind]:
        for rows in (1, 3, 9, 17):  # one pass of 8 rows and its rest, two passes of 8 and one more
            x = rng.standard_normal((rows, k)).astype(np.float32)
            packed, w = _matrix(rng, kind, 37, k)  # 37 output rows: three panels, the last with 5 live lanes
            (out,) = _run(x, [packed], arch)
            want = _expected(x, w)
            assert out.shape == want.shape == (rows, 37)
            np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5 * np.sqrt(k) * np.abs(want).max())


@pytest.mark.parametrize("kind", KINDS)
def test_a_rows_result_does_not_depend_on_the_other_rows(kind):
    """Batch invariance: each row of a 70-row product equals, bit for bit, the same row computed in a product of 1,
    2, 5, 8, 9, 16 or 33 rows starting anywhere (passes of 8 rows and their rests, blocks of 64)."""
    rng = np.random.default_rng(3)
    k = 576
    packed, _ = _matrix(rng, kind, 300, k)
    x = rng.standard_normal((70, k)).astype(np.float32)
    (full,) = _run(x, [packed])
    for m in (1, 2, 5, 8, 9, 16, 33):
        for start in (0, 3, 70 - m):
            (part,) = _run(x[start : start + m], [packed])
            np.testing.assert_array_equal(part, full[start : start + m], err_msg=f"{m} rows from {start}")


@pytest.mark.skipif(SCALAR is None, reason="the scalar build is x86-64's (gcc -march=x86-64)")
@pytest.mark.parametrize("kind", ["float32", "int8", "int8g", "int4"])
def test_the_scalar_build_gives_the_vector_builds_bits(kind):
    """Integer sums are exact in any order and float32 takes one fused multiply-add per k in both, so a machine
    without AVX-512 computes what one with it does (kernels/cpu_matmul.cc)."""
    rng = np.random.default_rng(11)
    packed, _ = _matrix(rng, kind, 50, 576)
    x = rng.standard_normal((6, 576)).astype(np.float32)
    np.testing.assert_array_equal(_run(x, [packed])[0], _run(x, [packed], SCALAR)[0])


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8", "int8g", "int4"])
def test_packed_rows_read_back_the_matrix(kind):
    """PackedMatrix.rows (a tied head's embedding lookup) gives the weights' rows, padding panels included."""
    rng = np.random.default_rng(5)
    packed, w = _matrix(rng, kind, 37, 128)
    assert (
        isinstance(packed, PackedMatrix)
        and packed.shape == (37, 128)
        and packed.kind == {"int8g": "int8"}.get(kind, kind)
    )
    ids = jnp.asarray([[0, 36], [17, 5]])
    want = np.asarray(w, np.float32) if isinstance(w, np.ndarray) else np.asarray(dequantized(w))
    np.testing.assert_array_equal(np.asarray(packed.rows(ids)), want[np.asarray(ids)])


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8g", "int4"])
def test_stacked_layers_in_place_and_several_matrices_per_call(kind):
    """[L, ...] panels with a traced layer index (clamped into range), three matrices of different widths in one
    call (q, k and v), inside a scan as the forward runs them: each layer's product, as its own matrix gives."""
    rng = np.random.default_rng(7)
    k, layers = 128, 3
    mats = [_matrix(rng, kind, n, k, layers) for n in (64, 16, 24)]
    x = jnp.asarray(rng.standard_normal((2, k)), jnp.float32)

    def body(carry, index):
        return carry, cpu.cpu_matmul(x, index, [m for m, _ in mats])

    _, outs = jax.jit(lambda: jax.lax.scan(body, 0, jnp.arange(layers, dtype=jnp.int32)))()
    for i in range(layers):
        for (_, w), out in zip(mats, outs):
            one = w[i] if isinstance(w, np.ndarray) else type(w)(w.q[i], w.scale[i])
            (alone,) = _run(np.asarray(x), [_matrix_of(one)])
            np.testing.assert_array_equal(np.asarray(out[i]), alone)
    (past,) = cpu.cpu_matmul(x, 99, [mats[0][0]])  # clamped to the last layer
    np.testing.assert_array_equal(np.asarray(past), np.asarray(outs[0][-1]))


def _matrix_of(w):
    if isinstance(w, np.ndarray):
        return pack_float(w)
    return (pack_int8 if isinstance(w, Int8Matrix) else pack_int4)(w.q, w.scale)


def test_concurrent_calls_from_threads_share_the_helpers():
    """Calls from several Python threads at once (two engines' steps): one job holds the helpers, the others run
    on their own threads; every result is right."""
    rng = np.random.default_rng(3)
    packed, _ = _matrix(rng, "int8", 256, 576)
    f = jax.jit(lambda x: cpu.cpu_matmul(x, 0, [packed])[0])
    xs = [jnp.asarray(rng.standard_normal((1 + i % 5, 576)), jnp.float32) for i in range(24)]
    expected = [np.asarray(f(x)) for x in xs]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda x: np.asarray(f(x)), xs * 3))
    for out, want in zip(outs, expected * 3):
        np.testing.assert_array_equal(out, want)


def test_one_thread_setting_gives_the_same_numbers(tmp_path):
    """SGJAX_CPU_THREADS=1 (no helpers: a process sharing its cores) computes what the helpers do, in a child."""
    rng = np.random.default_rng(11)
    packed, _ = _matrix(rng, "int4", 512, 576)
    x = rng.standard_normal((3, 576)).astype(np.float32)
    np.savez(tmp_path / "in.npz", panels=np.asarray(packed.panels), params=np.asarray(packed.params), x=x)
    code = (
        "import numpy as np, jax.numpy as jnp; from sgjax.kernels import cpu; "
        "from sgjax.kernels.cpu_pack import PackedMatrix; d = np.load('in.npz'); "
        "m = PackedMatrix(jnp.asarray(d['panels']), jnp.asarray(d['params']), 512, 576); "
        "np.save('out.npy', np.asarray(cpu.cpu_matmul(jnp.asarray(d['x']), 0, [m])[0]))"
    )
    env = {**os.environ, "SGJAX_CPU_THREADS": "1", "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, check=True, timeout=300)
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), _run(x, [packed])[0])


def test_refusals_name_the_operand():
    x = jnp.ones((2, 64), jnp.float32)
    good, _ = _matrix(np.random.default_rng(0), "int8", 16, 64)
    with pytest.raises(Exception, match="integer panels need their float32 params"):
        jax.block_until_ready(cpu.cpu_matmul(x, 0, [PackedMatrix(good.panels, jnp.zeros((1,)), 16, 64)]))
    with pytest.raises(Exception, match="panels must be"):
        jax.block_until_ready(cpu.cpu_matmul(x, 0, [PackedMatrix(jnp.ones((1, 32 * 16)), good.params, 16, 64)]))
    with pytest.raises(Exception, match="float32, bfloat16, uint8 \\(int4\\) or int8"):
        jax.block_until_ready(
            cpu.cpu_matmul(x, 0, [PackedMatrix(jnp.ones((1, 64 * 16), jnp.float16), good.params, 16, 64)])
        )
    with pytest.raises(ValueError, match="x has K=64, a matrix K=32"):
        cpu.cpu_matmul(x, 0, [PackedMatrix(jnp.ones((1, 32 * 16)), good.params, 16, 32)])
    with pytest.raises(ValueError, match="bfloat16 with an even K"):
        pack_float(np.ones((4, 3), jnp.bfloat16))


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
    np.testing.assert_allclose(
        np.asarray(quantize_int4(w[0]).rows(jnp.asarray([2]))), np.asarray(dequantized(quantize_int4(w[0])))[[2]]
    )
    with pytest.raises(ValueError, match="multiple of 64"):
        quantize_int4(w[..., :96])
