"""An fp8 KV pool (--kv-cache-dtype fp8_e4m3 / fp8_e5m2): stores saturate at the format's range, and the backends
that read it (ref, cpu: the native kernel, and pallas: its Triton kernel, in interpret mode here) widen the keys and
values to the queries' dtype. The cases' inputs are fp8 values already, so the numpy expectation is exact: any error
is the backend's."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgjax.kernels import cpu_attention, pallas_attention, ref_attention
from sgjax.kernels.kv_pool import allocate_pool, write_kv
from sgjax.model.kv_scales import KvScales, scaled
from tests.kernels.test_ref_attention import CASES, make_case

FP8 = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}


class Fp8Values:
    """A numpy Generator whose normal draws are fp8 values (so a float32 case holds exactly what an fp8 pool stores)."""

    def __init__(self, seed, dtype):
        self.rng, self.dtype = np.random.default_rng(seed), dtype

    def standard_normal(self, shape):
        return self.rng.standard_normal(shape).astype(self.dtype).astype(np.float32)

    def permutation(self, x):
        return self.rng.permutation(x)


def fp8_case(case, fmt, heads=(8, 2), q_dtype=jnp.float32):
    args, expected, total = make_case(
        Fp8Values(len(case), FP8[fmt]), num_heads=heads[0], num_kv_heads=heads[1], **CASES[case]
    )
    q, k, v, pool, layer, meta = args
    return (q.astype(q_dtype), k, v, pool.astype(FP8[fmt]), layer, meta), expected, total


@pytest.mark.parametrize("fmt", sorted(FP8))
def test_stores_saturate_at_the_formats_range(fmt):
    dtype = FP8[fmt]
    big = float(jnp.finfo(dtype).max)
    pool = allocate_pool(1, 2, 4, 1, 4, dtype)
    k = jnp.array([[[1e6, -1e6, 0.3, big * 0.99]]], jnp.float32)
    new = np.asarray(write_kv(pool, 0, k, -k, jnp.array([5], jnp.int32)).astype(jnp.float32))[0, 1, 1]
    assert np.isfinite(new).all()
    np.testing.assert_array_equal(new[0, :2], [big, -big])
    np.testing.assert_array_equal(new[1, :2], [-big, big])
    np.testing.assert_array_equal(new[0, 2:], np.asarray(k[0, 0, 2:].astype(dtype).astype(jnp.float32)))


BACKENDS = {
    "ref-gather": functools.partial(ref_attention, strategy="gather"),
    "ref-segment": functools.partial(ref_attention, strategy="segment"),
    "ref-paged": functools.partial(ref_attention, strategy="paged"),
    "pallas": pallas_attention,  # the Triton kernel (interpret mode on a CPU)
    "pallas-tpu": functools.partial(pallas_attention, platform="tpu", tpu_kernel="sgjax", interpret=True),  # ours
    "cpu": cpu_attention,  # kernels/cpu_attention.cc
}


@pytest.mark.parametrize("case", ["mixed", "padded"])
@pytest.mark.parametrize("fmt", sorted(FP8))
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_backends_read_an_fp8_pool_exactly(backend, fmt, case):
    args, expected, total = fp8_case(case, fmt)
    q, k, v, pool, layer, meta = args
    attend = jax.jit(functools.partial(BACKENDS[backend], sm_scale=q.shape[-1] ** -0.5))
    out, new_pool = attend(*args)
    assert new_pool.dtype == pool.dtype and out.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(out)[:total], expected[:total], atol=2e-5, rtol=1e-5)
    assert np.isfinite(np.asarray(out)).all()
    flat = np.asarray(new_pool.astype(jnp.float32))[layer].reshape(-1, 2 * k.shape[1], q.shape[-1])
    slots = np.asarray(meta.slot_mapping)[:total]
    np.testing.assert_array_equal(flat[slots, 0::2], np.asarray(k)[:total])
    np.testing.assert_array_equal(flat[slots, 1::2], np.asarray(v)[:total])


@pytest.mark.parametrize("backend", ["ref-paged", "pallas", "pallas-tpu", "cpu"])
def test_bf16_queries_over_an_fp8_pool(backend):
    """The GPU's combination: bf16 activations, e4m3 pages widened to bf16 (not the probabilities narrowed to fp8)."""
    args, expected, total = fp8_case("mixed", "e4m3", q_dtype=jnp.bfloat16)
    q = args[0]
    out, _ = jax.jit(functools.partial(BACKENDS[backend], sm_scale=q.shape[-1] ** -0.5))(*args)
    out = np.asarray(out.astype(jnp.float32))[:total]
    assert np.linalg.norm(out - expected[:total]) / np.linalg.norm(expected[:total]) < 1e-2


@pytest.mark.parametrize("fmt", sorted(FP8))
def test_scaled_pool_under_the_cpu_kernel_equals_ref(fmt):
    """kv_scales.scaled around the cpu backend (the engine's wrapping under --quantization-param-path): the pool's
    bytes equal ref's under the same scales, per layer and KV head, and so does the output to rounding."""
    args, _, total = fp8_case("mixed", fmt)
    q, k, v, pool, layer, meta = args
    k, v = k * 300.0, v / 300.0  # past e4m3's 448 unscaled, or under its smallest steps
    scales = KvScales(k=(1.0, (100.0, 400.0)), v=(1.0, (0.003, 0.01)), source="test")
    runs = {}
    for name, backend in (("cpu", cpu_attention), ("ref", ref_attention)):
        attend = jax.jit(functools.partial(scaled(backend, scales), sm_scale=q.shape[-1] ** -0.5))
        out, new_pool = attend(q, k, v, pool, jnp.int32(layer), meta)
        runs[name] = np.asarray(out)[:total], np.asarray(new_pool).view(np.uint8)
    np.testing.assert_array_equal(runs["cpu"][1], runs["ref"][1])
    np.testing.assert_allclose(runs["cpu"][0], runs["ref"][0], atol=2e-5, rtol=1e-5)
