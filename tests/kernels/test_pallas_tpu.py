"""The TPU path without a TPU: the wrapper's operand conversion, and lowering to Mosaic.

What runs here: (1) our wrapper around jax's ragged_paged_attention with the op replaced by jax's own
reference of it (ref_ragged_paged_attention, eager), against the numpy expectation; this checks the
layer-as-page-offset trick, num_seqs and the padded rows; (2) jax.export of the real kernel for
platform "tpu" under an abstract TPU v5e device, which runs the Pallas -> Mosaic lowering on CPU.
Not run: the kernel itself (jax 0.10.2's TPU interpret mode stops at the kernel's ref.reshape with
"'ReshapeTransform' object has no attribute 'indices'") and Mosaic's compilation, which needs a TPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

from sgjax.kernels.metadata import AttentionMetadata
from sgjax.kernels.pallas_tpu import pallas_tpu_attention, tpu_operands
from tests.kernels.test_ref_attention import CASES, make_case


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
    meta = AttentionMetadata(slot_mapping=jnp.zeros(2, jnp.int32), cu_q_lens=jnp.array([0, 1, 2], jnp.int32),
                             kv_lens=jnp.array([3, 6], jnp.int32), page_table=jnp.array([[1, 0], [2, 3]], jnp.int32))
    kv_pages, kv_lens, pages, cu, num_seqs = tpu_operands(pool, jnp.int32(2), meta)
    assert kv_pages.shape == (15, 4, 2, 8)
    np.testing.assert_array_equal(pages, [[11, 10], [12, 13]])
    np.testing.assert_array_equal(num_seqs, [2])


def test_lowers_to_mosaic_for_tpu():
    t, heads, kv_heads, d, layers, pages, page_size, reqs, per_req = 64, 16, 4, 128, 2, 64, 16, 8, 8
    spec = jax.ShapeDtypeStruct
    meta = AttentionMetadata(slot_mapping=spec((t,), jnp.int32), cu_q_lens=spec((reqs + 1,), jnp.int32),
                             kv_lens=spec((reqs,), jnp.int32), page_table=spec((reqs, per_req), jnp.int32))
    args = (spec((t, heads, d), jnp.bfloat16), spec((t, kv_heads, d), jnp.bfloat16),
            spec((t, kv_heads, d), jnp.bfloat16), spec((layers, pages, page_size, 2 * kv_heads, d), jnp.bfloat16),
            spec((), jnp.int32), meta)

    def step(q, k, v, pool, layer, meta):
        return pallas_tpu_attention(q, k, v, pool, layer, meta, sm_scale=0.088, num_kv_pages_per_block=4,
                                    num_queries_per_block=16)

    # Mosaic's lowering asks the device for its TPU generation; an abstract mesh supplies one.
    device = jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        exported = jax.export.export(jax.jit(step), platforms=["tpu"])(*args)
    text = exported.mlir_module()
    assert "tpu_custom_call" in text and "ragged_paged_attention_kernel" in text
    assert exported.out_avals[0].shape == (t, heads, d)
