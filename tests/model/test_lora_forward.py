"""The forward's LoRA deltas (model/lora.py) on the tiny model: rows of a slot get exactly what the adapter merged into
the weights gives, rows of no slot get the base model, and the scanned and unrolled layer loops agree."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from sgjax.kernels import allocate_pool, get_backend
from sgjax.model import lora as lora_mod
from sgjax.model.batch import build_batch
from sgjax.model.llama import forward
from sgjax.model.presets import TINY_SMOLLM2_VOCAB
from sgjax.model.weights import dummy_weights, unstack_layers

CFG = dataclasses.replace(TINY_SMOLLM2_VOCAB, vocab_size=512)
RANK, SLOTS = 4, 3


def adapters(seed: int):
    """Two random adapters over different modules and ranks (model/lora.Adapter)."""
    rng = np.random.default_rng(seed)
    out = []
    for name, rank, modules in (("x", 4, ("q_proj", "v_proj", "down_proj")), ("y", 2, ("k_proj", "o_proj", "up_proj"))):
        a, b = {}, {}
        for m in modules:
            fan_in, fan_out = lora_mod.module_shape(CFG, m)
            a[m] = rng.standard_normal((CFG.num_layers, fan_in, rank)).astype(np.float32) * 0.3
            b[m] = rng.standard_normal((CFG.num_layers, rank, fan_out)).astype(np.float32) * 0.3
        out.append(lora_mod.Adapter(name, "", rank, a, b))
    return out


def merged(weights, adapter):
    layers = weights.layers
    for m in adapter.a:
        name = lora_mod.MODULES[m]
        layers = dataclasses.replace(layers, **{name: getattr(layers, name) + adapter.a[m] @ adapter.b[m]})
    return dataclasses.replace(weights, layers=layers)


def run(weights, slots, stacks):
    chunks = [[5, 9, 33, 100, 7, 61], [2, 3, 4], [400, 11, 12, 13, 200]]
    batch = build_batch(chunks, [6, 3, 5], [[1], [2], [3]], 8, 16, 4, 1, logits_rows=list(range(14)), num_logits=16)
    batch = jax.tree.map(jnp.asarray, batch)
    pool = allocate_pool(CFG.num_layers, 4, 8, CFG.num_kv_heads, CFG.head_dim, dtype=jnp.float32)
    rows = np.full(16, -1, np.int32)
    rows[:14] = np.repeat(slots, [6, 3, 5])
    lora = None if stacks is None else (stacks, jnp.asarray(rows))
    with jax.default_matmul_precision("highest"):
        logits, _ = forward(weights, pool, batch, cfg=CFG, attention=get_backend("ref"), lora=lora)
    return np.asarray(logits)[:14]


def test_each_row_gets_its_own_adapter_and_the_loops_agree():
    weights = dummy_weights(CFG)
    x, y = adapters(0)
    stacks = lora_mod.empty_stacks(CFG, list(lora_mod.MODULES), SLOTS, RANK, jnp.float32)
    for slot, adapter in ((2, x), (0, y)):
        stacks = lora_mod.write_slot(stacks, np.int32(slot), *lora_mod.slot_values(stacks, adapter))
    got = run(weights, [2, -1, 0], stacks)  # x, the base model, y
    want_x, want_base, want_y = (run(w, [-1, -1, -1], None) for w in (merged(weights, x), weights, merged(weights, y)))
    np.testing.assert_allclose(got[:6], want_x[:6], rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(got[6:9], want_base[6:9])  # a base row adds exact zeros
    np.testing.assert_allclose(got[9:], want_y[9:], rtol=2e-5, atol=2e-5)
    assert np.abs(want_x[:6] - want_base[:6]).max() > 1e-2  # the adapters change the logits
    np.testing.assert_allclose(run(unstack_layers(weights), [2, -1, 0], stacks), got, rtol=1e-5, atol=1e-5)
