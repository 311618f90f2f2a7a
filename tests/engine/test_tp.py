"""Tensor parallelism (engine/mesh.py) against one device: the same greedy tokens and logprobs through the whole
engine (radix-cache hits, chunked prefill, the overlap loop, a regex mask, penalties), each device holding 1/N of
every sharded weight and of the KV pool, the donated state keeping its sharding with no recompiles, and the Pallas
kernel under shard_map. The session has 4 CPU host devices (tests/conftest.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgjax.engine import mesh as tp
from sgjax.engine.args import ServerArgs
from sgjax.engine.engine import Engine
from sgjax.model.presets import TINY_GEMMA3_SMOLLM2_VOCAB, TINY_QWEN2_SMOLLM2_VOCAB
from sgjax.model.weights import dummy_weights
from tests.conftest import SMALL
from tests.engine.conftest import FEW_SHOT

# Longer than SMALL's 96-token prefill chunk: it is prefilled in two steps; the second round's first prompt
# extends it, so its prefix comes from the radix cache.
LONG = FEW_SHOT * 2 + "Q: What is the color of grass?\nA:"
ROUND2 = [
    (LONG + " Green\nQ: What do bees make?\nA:", {}),
    ("Answer yes or no, then a number:", {"regex": "(yes|no) [0-9]{2}"}),
    (
        "The quick brown fox jumps over the lazy dog. The quick brown",
        {"frequency_penalty": 0.8, "repetition_penalty": 1.3},
    ),
    ("Hello", {}),
]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def models(tiny):
    """name -> (config, weights, tokenizer): the tiny Llama (4 q heads on 2 KV heads) and a tiny Qwen2 (biases)."""
    cfg, weights, tok = tiny
    return {
        "llama": tiny,
        "qwen2": (TINY_QWEN2_SMOLLM2_VOCAB, dummy_weights(TINY_QWEN2_SMOLLM2_VOCAB, seed=2), tok),
        "gemma3": (TINY_GEMMA3_SMOLLM2_VOCAB, dummy_weights(TINY_GEMMA3_SMOLLM2_VOCAB, seed=3), tok),
    }


def workload(engine) -> list[tuple[list[int], list[float], int]]:
    """(output ids, output logprobs, cached tokens) of every request: one long prompt, then a batch that reuses
    its prefix, with a regex and a penalised request among them."""

    def run(prompts, extras):
        params = [{"max_new_tokens": NEW_TOKENS, "temperature": 0.0, **x} for x in extras]
        out = engine.generate(prompts, params, return_logprob=True)
        # a grammar's forced (jump-forward) tokens have no logprob: NaN, compared as equal
        return [
            (
                o["output_ids"],
                [np.nan if lp is None else lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]],
                o["meta_info"]["cached_tokens"],
            )
            for o in out
        ]

    return run([LONG], [{}]) + run([p for p, _ in ROUND2], [x for _, x in ROUND2])


@pytest.fixture(scope="module")
def engines(models):
    made = {}

    def get(name, tp_size):
        if (name, tp_size) not in made:
            made[name, tp_size] = Engine.from_weights(*models[name], **SMALL, tp_size=tp_size)
        return made[name, tp_size]

    yield get
    for e in made.values():
        e.shutdown()


@pytest.fixture(scope="module")
def expected(engines):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = workload(engines(name, 1))
        return cache[name]

    return get


def assert_same(got, want):
    for (ids, lps, cached), (ids1, lps1, cached1) in zip(got, want, strict=True):
        assert ids == ids1
        np.testing.assert_allclose(lps, lps1, atol=2e-4, rtol=0)
        assert cached == cached1
    assert want[1][2] > 0  # the shared prefix did come from the cache
    lengths = [len(ids) for ids, _, _ in want]
    assert lengths[2] < NEW_TOKENS and lengths[:2] + lengths[3:] == [NEW_TOKENS] * 4  # the regex ("no 42") ends early


# Qwen2 at TP=4: more devices than its 2 KV heads, each head and its K/V biases copied twice. Not every pair: each
# engine compiles its own step shapes (~30 s cold on 2 cores). Gemma 3: a window the long prompt crosses, in the
# scanned loop (a traced window under shard_map), and its one KV head copied to both devices.
@pytest.mark.parametrize("name, tp_size", [("llama", 2), ("qwen2", 4), ("gemma3", 2)])
def test_greedy_outputs_and_logprobs_equal_one_device(engines, expected, name, tp_size):
    engine = engines(name, tp_size)
    got = workload(engine)
    assert_same(got, expected(name))
    # the same workload again from an empty cache: the same outputs, and a compile only for a step shape the first
    # run did not meet (arrival timing may batch a step differently), never a shape again: the state's sharding kept
    traces, seen = engine.runner.traces, set(engine.runner.shapes_seen)
    assert engine.flush_cache()
    assert_same(workload(engine), expected(name))
    assert engine.runner.traces - traces == len(engine.runner.shapes_seen - seen)
    state = engine.runner.state
    assert state.pool.sharding.is_equivalent_to(tp.pool_sharding(engine.mesh), state.pool.ndim)
    assert state.future.sharding.is_equivalent_to(tp.replicated(engine.mesh), 1)


@pytest.mark.parametrize("name, tp_size", [("llama", 2), ("qwen2", 4)])  # engines the test above made
def test_each_device_holds_its_share(engines, name, tp_size):
    engine = engines(name, tp_size)
    cfg, w = engine.runner.cfg, engine.runner.weights
    assert engine.mesh.shape == {"data": 1, "tensor": tp_size}
    assert cfg.num_kv_heads == max(2, tp_size)  # KV heads copied up to tp
    layers = w.layers
    biases = [("bq", 1), ("bk", 1), ("bv", 1)] if name == "qwen2" else []
    for leaf, axis in [("wq", 2), ("wk", 2), ("wv", 2), ("w_gate", 2), ("w_up", 2), ("wo", 1), ("w_down", 1)] + biases:
        a = getattr(layers, leaf)
        shards = a.addressable_shards
        assert len(shards) == tp_size and len({s.device for s in shards}) == tp_size, leaf
        want = list(a.shape)
        want[axis] //= tp_size
        assert all(list(s.data.shape) == want for s in shards), (leaf, [s.data.shape for s in shards])
        assert all(s.data.nbytes * tp_size == a.nbytes for s in shards), leaf
    for a in (w.embed, w.lm_head, layers.attn_norm):  # replicated: every device has all of it
        if a is None:  # the tied Llama's head is its embedding
            continue
        assert all(s.data.shape == a.shape for s in a.addressable_shards)
    pool = engine.runner.state.pool
    assert pool.shape[3] == 2 * cfg.num_kv_heads
    assert {s.data.shape[3] for s in pool.addressable_shards} == {2 * cfg.num_kv_heads // tp_size}
    per_device = tp.addressable_bytes(pool)
    assert len(per_device) == tp_size and set(per_device.values()) == {pool.nbytes // tp_size}


def test_kv_heads_expanded_in_place():
    cfg = TINY_QWEN2_SMOLLM2_VOCAB  # 2 KV heads of 16
    wk = np.arange(2 * 3 * 32, dtype=np.float32).reshape(2, 3, 32)
    out = tp.expand_kv(wk, cfg, 4)
    assert out.shape == (2, 3, 64)
    heads = out.reshape(2, 3, 4, 16)
    for h in range(4):  # q heads 2h, 2h+1 read KV head h // 2 before and copy h after
        np.testing.assert_array_equal(heads[:, :, h], wk.reshape(2, 3, 2, 16)[:, :, h // 2])
    np.testing.assert_array_equal(np.asarray(tp.expand_kv(jnp.asarray(wk), cfg, 4)), out)
    assert tp.expand_kv(wk, cfg, 2) is wk


def test_real_smollm2_three_ways_under_an_explicit_float32(smollm2):
    """SmolLM2-135M (9 heads on 3 KV heads) split 3 ways with --dtype float32: the greedy tokens of one device (which
    runs the native kernel's float32 there, where TP=3 runs XLA's dots: float32 either way, as asked)."""
    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Water boils at",
        "Once upon a time,",
        "The three primary colors are",
    ]
    params = {"max_new_tokens": 16, "temperature": 0.0}
    outs = {}
    for tp_size in (1, 3):
        with Engine(**SMALL, dtype="float32", tp_size=tp_size) as engine:
            assert engine.plan.weight_dtype == engine.plan.kv_dtype == "float32"
            outs[tp_size] = [o["output_ids"] for o in engine.generate(prompts, params)]
    assert outs[3] == outs[1]
    assert all(outs[1])


def test_dummy_weights_born_sharded_equal_unsharded():
    cfg = TINY_QWEN2_SMOLLM2_VOCAB
    mesh = tp.make_mesh(4)
    sharded = tp.dummy_weights(cfg, mesh, seed=5)
    plain = dummy_weights(cfg, seed=5)
    assert sharded.layers.wq.sharding.spec == jax.sharding.PartitionSpec(None, None, "tensor")
    np.testing.assert_array_equal(np.asarray(sharded.layers.wq), np.asarray(plain.layers.wq))
    np.testing.assert_array_equal(np.asarray(sharded.layers.wk), tp.expand_kv(np.asarray(plain.layers.wk), cfg, 4))
    np.testing.assert_array_equal(np.asarray(sharded.embed), np.asarray(plain.embed))


def test_pallas_kernel_under_shard_map_matches_ref():
    """The GPU Pallas kernel (interpret mode on CPU) under shard_map on 2 devices, against `ref` unsharded."""
    from sgjax.kernels import pallas_attention, ref_attention
    from tests.kernels.test_ref_attention import make_case

    rng = np.random.default_rng(7)
    (q, k, v, pool, layer, meta), _, total = make_case(
        rng, q_lens=[1, 5, 1], prefix_lens=[6, 0, 9], page_size=4, num_heads=4, num_kv_heads=2
    )
    mesh = tp.make_mesh(2)
    want, want_pool = jax.jit(lambda *a: ref_attention(*a, sm_scale=0.25))(q, k, v, pool, layer, meta)
    heads = jax.sharding.NamedSharding(mesh, tp.HEADS_SPEC)
    args = (
        jax.device_put(q, heads),
        jax.device_put(k, heads),
        jax.device_put(v, heads),
        jax.device_put(pool, tp.pool_sharding(mesh)),
        layer,
        meta,
    )
    attend = tp.sharded_attention(pallas_attention, mesh)
    got, got_pool = jax.jit(lambda *a: attend(*a, sm_scale=0.25))(*args)
    assert got_pool.sharding.is_equivalent_to(tp.pool_sharding(mesh), got_pool.ndim)
    assert {s.data.shape[1] for s in got.addressable_shards} == {2}  # each device attended 2 of the 4 q heads
    np.testing.assert_allclose(np.asarray(got)[:total], np.asarray(want)[:total], atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(np.asarray(got_pool), np.asarray(want_pool))


@pytest.mark.parametrize(
    "tp_size, message",
    [
        (8, "tp_size=8 needs 8 devices"),
        (3, "tp_size=3 must divide the model's 4 attention heads"),
        (0, "tp_size must be a positive integer"),
    ],
)
def test_bad_tp_size_fails_at_start(tiny, tp_size, message):
    with pytest.raises(ValueError, match=message):
        Engine.from_weights(*tiny, **SMALL, tp_size=tp_size)


def test_kv_heads_that_do_not_split():
    cfg = TINY_QWEN2_SMOLLM2_VOCAB.replace(num_heads=12, num_kv_heads=3, intermediate_size=120)
    with pytest.raises(ValueError, match="tp_size=2 and the model's 3 KV heads"):
        tp.check_model(cfg, 2)
    tp.check_model(cfg, 3)
    tp.check_model(cfg, 6)


def test_tp_size_flag():
    from sgjax.cli import build_parser, split_args

    engine, _ = split_args(build_parser().parse_args(["serve", "--tp-size", "2"]))
    assert engine == ServerArgs(tp_size=2)


def test_server_with_tp_size_flag(smollm2):
    """`sgjax serve --tp-size 3` (a child process with 4 CPU host devices): one /generate answered with the greedy
    text of one device, and /get_server_info reporting the mesh."""
    import httpx

    from tests.server.conftest import SMALL_FLAGS, serving

    prompt, params = "The capital of France is", {"max_new_tokens": 6, "temperature": 0.0}
    engine = Engine.from_weights(*smollm2, **SMALL)
    try:
        want = engine.generate(prompt, params)["text"]
    finally:
        engine.shutdown()
    srv = serving(*SMALL_FLAGS, "--tp-size", "3", env={"JAX_NUM_CPU_DEVICES": "4"})
    server = next(srv)
    try:
        with httpx.Client(base_url=server.url, timeout=120) as c:
            assert c.post("/generate", json={"text": prompt, "sampling_params": params}).json()["text"] == want
            info = c.get("/get_server_info").json()
        assert info["tp_size"] == 3 and info["mesh_shape"] == {"data": 1, "tensor": 3}
    finally:
        next(srv, None)  # stops the server; it must exit cleanly


def test_unstacked_layers_keep_their_partitioning(models):
    """The accelerators' per-layer weights (an unrolled forward) come from placed stacked ones slice by slice."""
    cfg, weights, _ = models["qwen2"]
    mesh = tp.make_mesh(4)
    placed = tp.place_weights(cfg, weights, mesh)
    layers = tp.unstack_placed(placed, mesh).layers
    assert len(layers) == cfg.num_layers
    P = jax.sharding.PartitionSpec
    for i, layer in enumerate(layers):
        assert layer.wq.sharding.spec == P(None, "tensor") and layer.wo.sharding.spec == P("tensor", None)
        assert layer.bk.sharding.spec == P("tensor")
        assert {s.data.shape for s in layer.wk.addressable_shards} == {(cfg.hidden_size, cfg.head_dim)}
        np.testing.assert_array_equal(np.asarray(layer.wv), np.asarray(placed.layers.wv[i]))


def test_dummy_load_format_is_born_sharded(tmp_path):
    """--load-format dummy with --tp-size: the checkpoint config's random weights made on the mesh, KV heads copied."""
    import json

    from sgjax.engine.loading import load_model_cached

    (tmp_path / "config.json").write_text(
        json.dumps(
            dict(
                model_type="llama",
                architectures=["LlamaForCausalLM"],
                vocab_size=320,
                hidden_size=64,
                intermediate_size=160,
                num_hidden_layers=2,
                num_attention_heads=8,
                num_key_value_heads=2,
                max_position_embeddings=512,
                rms_norm_eps=1e-6,
            )
        )
    )
    mesh = tp.make_mesh(4)
    cfg, weights = load_model_cached(str(tmp_path), "float32", "dummy", mesh=mesh)
    assert weights.layers.wq.sharding.spec == jax.sharding.PartitionSpec(None, None, "tensor")
    assert weights.layers.wk.shape[-1] == 4 * cfg.head_dim  # 2 KV heads, each copied to 2 devices
    plain = dummy_weights(cfg)
    np.testing.assert_array_equal(np.asarray(weights.layers.wk), tp.expand_kv(np.asarray(plain.layers.wk), cfg, 4))
    again = tp.place_weights(cfg, weights, mesh)  # what the engine does next: nothing to move, nothing to expand
    assert again.layers.wk is weights.layers.wk and again.embed is weights.embed
    with pytest.raises(ValueError, match="tp_size=3 must divide the model's 8 attention heads"):
        load_model_cached(str(tmp_path), "float32", "dummy", mesh=tp.make_mesh(3))


def test_checkpoint_loaded_onto_the_mesh(smollm2):
    """A checkpoint with a mesh is read to host memory and each device gets only its slice (the GGUF SmolLM2)."""
    from sgjax.engine import loading

    mesh = tp.make_mesh(3)
    key = (None, "float32", "auto", mesh)
    try:
        cfg, weights = loading.load_model_cached(None, "float32", mesh=mesh)
        wq = weights.layers.wq
        assert wq.sharding.spec == jax.sharding.PartitionSpec(None, None, "tensor")
        assert {s.data.shape[-1] for s in wq.addressable_shards} == {cfg.q_size // 3}
        np.testing.assert_array_equal(np.asarray(wq), np.asarray(smollm2[1].layers.wq))
        per_device = tp.addressable_bytes(weights)
        replicated = sum(
            a.nbytes for a in (weights.embed, weights.final_norm, weights.layers.attn_norm, weights.layers.mlp_norm)
        )
        total = sum(a.nbytes for a in jax.tree.leaves(weights))
        assert set(per_device.values()) == {replicated + (total - replicated) // 3}
    finally:
        loading.MODELS.pop(key, None)


def test_host_assembly_stays_numpy():
    """What the mesh loading relies on: assemble(host=True) hands over numpy arrays, not device-0 arrays."""
    from sgjax.model import weights as W
    from sgjax.model.presets import MICRO_LLAMA

    arrays = {name: np.ones(shape, np.float32) for name, shape in W.shapes(MICRO_LLAMA).items()}
    host = W.assemble(MICRO_LLAMA, arrays, host=True)
    assert all(isinstance(a, np.ndarray) for a in jax.tree.leaves(host))
    assert all(isinstance(a, jax.Array) for a in jax.tree.leaves(W.assemble(MICRO_LLAMA, arrays)))


def test_encode_and_score_on_the_mesh(engines):
    """The scratch-prefill paths (embeddings, /v1/score) run on the placed weights of the sharded config."""
    one, four = engines("llama", 1), engines("llama", 4)
    prompts = ["The capital of France is", "Hello"]
    np.testing.assert_allclose(four.encode(prompts), one.encode(prompts), atol=1e-5)
    args = dict(query="Is the sky blue? Answer:", items=[" yes", " no"], label_token_ids=[5, 17, 300])
    np.testing.assert_allclose(four.score(**args), one.score(**args), atol=1e-5)
