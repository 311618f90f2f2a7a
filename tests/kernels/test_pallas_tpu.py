"""The TPU path without a TPU.

jax's ragged_paged_attention (the default on TPU): (1) our wrapper with the op replaced by jax's own reference of
it (ref_ragged_paged_attention, eager), against the numpy expectation; this checks the layer-as-page-offset trick,
num_seqs and the padded rows; (2) jax.export of the real kernel for platform "tpu" under an abstract TPU v5e
device, which runs the Pallas -> Mosaic lowering on CPU. Its kernel cannot run here: TPU interpret mode stops at
its ref.reshape ("'ReshapeTransform' object has no attribute 'indices'").

Our own kernel (kernels/pallas_tpu_kernel.py): the kernel itself runs in TPU interpret mode (scalar prefetch,
DMAs, semaphores and the double-buffered key tiles executed op by op) on the contract cases, and lowers to Mosaic
for bf16/fp32 and head_dim 64/128. Mosaic's own compilation needs a TPU: not run.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

from sgjax.kernels import pallas_attention
from sgjax.kernels.metadata import AttentionMetadata
from sgjax.kernels.pallas_tpu import pallas_tpu_attention, tpu_operands
from sgjax.kernels.pallas_tpu_kernel import default_config, sgjax_tpu_attention
from tests.kernels.test_pallas_attention import _check, check_windowed
from tests.kernels.test_ref_attention import CASES, WINDOWED, make_case


def _reference_op(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale):
    # jax's reference returns only the real rows; the kernel returns all T rows.
    out = ref_ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale)
    return jnp.concatenate([out, jnp.full((q.shape[0] - out.shape[0],) + out.shape[1:], jnp.nan, out.dtype)])


@pytest.mark.parametrize("case", ["mixed", "padded", "prefix-hit-long"])
def test_wrapper_matches_expected(case):
    rng = np.random.default_rng(11)
    args, expected, total = make_case(rng, num_heads=8, num_kv_heads=2, **CASES[case])
    q, k, v, pool, layer, meta = args
    out, new_pool = pallas_tpu_attention(q, k, v, pool, layer, meta, sm_scale=q.shape[-1] ** -0.5, op=_reference_op)
    out = np.asarray(out)
    np.testing.assert_allclose(out[:total], expected[:total], atol=2e-5, rtol=1e-5)
    assert np.isfinite(out).all()  # the NaN the stand-in puts in padded rows was replaced
    np.testing.assert_array_equal(np.asarray(new_pool)[0], np.asarray(pool)[0])


def test_operands_offset_pages_by_layer():
    pool = jnp.zeros((3, 5, 4, 2, 8))
    meta = AttentionMetadata(
        slot_mapping=jnp.zeros(2, jnp.int32),
        cu_q_lens=jnp.array([0, 1, 2], jnp.int32),
        kv_lens=jnp.array([3, 6], jnp.int32),
        page_table=jnp.array([[1, 0], [2, 3]], jnp.int32),
    )
    kv_pages, kv_lens, pages, cu, num_seqs = tpu_operands(pool, jnp.int32(2), meta)
    assert kv_pages.shape == (15, 4, 2, 8)
    np.testing.assert_array_equal(pages, [[11, 10], [12, 13]])
    np.testing.assert_array_equal(num_seqs, [2])


def _export_for_tpu(attend, t, reqs, head_dim, dtype, heads=16, kv_heads=4, pool_dtype=None, **config):
    """jax.export of one attention call for platform "tpu" (the Pallas -> Mosaic lowering runs on CPU)."""
    layers, pages, page_size, per_req = 2, 64, 16, 8
    spec = jax.ShapeDtypeStruct
    meta = AttentionMetadata(
        slot_mapping=spec((t,), jnp.int32),
        cu_q_lens=spec((reqs + 1,), jnp.int32),
        kv_lens=spec((reqs,), jnp.int32),
        page_table=spec((reqs, per_req), jnp.int32),
    )
    args = (
        spec((t, heads, head_dim), dtype),
        spec((t, kv_heads, head_dim), dtype),
        spec((t, kv_heads, head_dim), dtype),
        spec((layers, pages, page_size, 2 * kv_heads, head_dim), pool_dtype or dtype),
        spec((), jnp.int32),
        meta,
    )

    def step(q, k, v, pool, layer, meta):
        return attend(q, k, v, pool, layer, meta, sm_scale=0.088, **config)

    # Mosaic's lowering asks the device for its TPU generation; an abstract mesh supplies one.
    device = jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        exported = jax.export.export(jax.jit(step), platforms=["tpu"])(*args)
    assert exported.out_avals[0].shape == (t, heads, head_dim)
    return exported.mlir_module()


def test_lowers_to_mosaic_for_tpu():
    text = _export_for_tpu(
        pallas_tpu_attention, 64, 8, 128, jnp.bfloat16, num_kv_pages_per_block=4, num_queries_per_block=16
    )
    assert "tpu_custom_call" in text and "ragged_paged_attention_kernel" in text


# -- our kernel, executed in TPU interpret mode --------------------------------------------------------------


@pytest.mark.parametrize(
    "case,heads,config",
    [
        ("mixed", (8, 2), {}),
        ("padded", (4, 4), {}),
        ("all-decode", (8, 1), {}),
        ("all-prefill", (8, 2), {"block_q": 8}),  # a 16-row request spans two query blocks
        ("prefix-hit-long", (8, 2), {"pages_per_block": 2}),  # 7 double-buffered key tiles
        ("page-crossing", (8, 2), {"pages_per_block": 1}),  # head_dim 128, page 8, tiles of one page
    ],
)
def test_own_kernel_in_interpret_mode(case, heads, config):
    _check(case, heads, attend=functools.partial(sgjax_tpu_attention, interpret=True), **config)


def test_own_kernel_bf16():
    rng = np.random.default_rng(5)
    args, expected, total = make_case(rng, num_heads=8, num_kv_heads=2, **CASES["mixed"], head_dim=64)
    bf16 = [a.astype(jnp.bfloat16) if i < 4 else a for i, a in enumerate(args)]
    out, _ = jax.jit(functools.partial(sgjax_tpu_attention, sm_scale=64**-0.5, interpret=True))(*bf16)
    assert out.dtype == jnp.bfloat16
    out = np.asarray(out.astype(jnp.float32))[:total]
    assert np.linalg.norm(out - expected[:total]) / np.linalg.norm(expected[:total]) < 1e-2


def test_own_kernel_through_the_backend():
    # pallas_attention(platform="tpu", tpu_kernel="sgjax") reaches our kernel; interpret mode since this is CPU.
    _check(
        "mixed", (8, 2), attend=functools.partial(pallas_attention, platform="tpu", tpu_kernel="sgjax", interpret=True)
    )


@pytest.mark.parametrize(
    "t,reqs,head_dim,dtype", [(64, 8, 128, jnp.bfloat16), (8, 8, 64, jnp.bfloat16), (256, 2, 128, jnp.float32)]
)
def test_own_kernel_lowers_to_mosaic(t, reqs, head_dim, dtype):
    text = _export_for_tpu(sgjax_tpu_attention, t, reqs, head_dim, dtype)
    assert "tpu_custom_call" in text and "sgjax_ragged_paged_attention" in text


@pytest.mark.parametrize("kernel", ["jax", "sgjax"])
def test_an_fp8_pool_lowers_to_mosaic_for_tpu(kernel):
    """bf16 queries over an e4m3 pool: jax's kernel given k_scale / v_scale (it widens the pages then), ours
    widening its VMEM tiles (executed in interpret mode: tests/kernels/test_fp8_pool.py)."""
    attend = functools.partial(pallas_tpu_attention, tpu_kernel=kernel)
    blocks = dict(num_kv_pages_per_block=4, num_queries_per_block=16) if kernel == "jax" else {}  # no TPU to tune for
    text = _export_for_tpu(attend, 64, 8, 128, jnp.bfloat16, pool_dtype=jnp.float8_e4m3fn, **blocks)
    assert "tpu_custom_call" in text and "f8E4M3FN" in text


def test_own_kernel_default_config():
    assert default_config(64, 64, 16, jnp.float32) == {"block_q": 8, "pages_per_block": 8}  # decode
    assert default_config(64, 64, 16, jnp.bfloat16)["block_q"] == 16  # bf16's sublane tile
    assert default_config(512, 4, 32, jnp.bfloat16) == {"block_q": 32, "pages_per_block": 4}


def _reference_op_masked(
    q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, sliding_window=None, soft_cap=None
):
    out = ref_ragged_paged_attention(
        q,
        kv_pages,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    return jnp.concatenate([out, jnp.zeros((q.shape[0] - out.shape[0],) + out.shape[1:], out.dtype)])


@pytest.mark.parametrize("case", sorted(WINDOWED))
def test_window_and_softcap_reach_jaxs_op_and_our_kernel(case):
    check_windowed(case, functools.partial(pallas_tpu_attention, op=_reference_op_masked), jit=False)
    check_windowed(case, functools.partial(sgjax_tpu_attention, interpret=True, block_q=8, pages_per_block=2))
