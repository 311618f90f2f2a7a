"""Narrow matrices under float32 activations (--weight-dtype; engine/plan.py): which leaves are cast or quantized, the
native kernel's logits against XLA's over the same weights, engines reporting what they run, the real SmolLM2's
answers in each dtype, and a GGUF's blocks kept exactly."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgjax.engine import loading
from sgjax.engine.engine import Engine
from sgjax.kernels import allocate_pool, get_backend
from sgjax.kernels.cpu_pack import PackedMatrix
from sgjax.model.batch import build_batch
from sgjax.model.llama import forward
from sgjax.model.loader import _unpermute, load_gguf
from sgjax.model.native import NATIVE, pack_weights
from sgjax.model.presets import TINY_LLAMA
from sgjax.model.quant import Int4Matrix, Int8Matrix, dequantized, int8_from_q8_0
from sgjax.model.weights import (
    MATMUL_LEAVES,
    QUANTIZED_LEAVES,
    TOP_MATRICES,
    LayerWeights,
    cast_matrices,
    dummy_weights,
    matrices_dtype,
    unstack_layers,
)
from tests.conftest import SMALL
from tests.engine.conftest import tiny_engine

GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def _leaves(weights):
    top = {f.name: getattr(weights, f.name) for f in dataclasses.fields(weights) if f.name != "layers"}
    layers = weights.layers if isinstance(weights.layers, LayerWeights) else weights.layers[0]
    return {**top, **{f.name: getattr(layers, f.name) for f in dataclasses.fields(layers)}}


@pytest.mark.parametrize("unrolled", [False, True], ids=["stacked", "unrolled"])
def test_only_the_matrices_are_cast(tiny, unrolled):
    cfg, weights, _ = tiny
    weights = unstack_layers(weights) if unrolled else weights
    cast = cast_matrices(weights, "bfloat16")
    assert matrices_dtype(cast) == "bfloat16" and matrices_dtype(weights) == "float32"
    for name, leaf in _leaves(cast).items():
        if leaf is not None:
            assert leaf.dtype == (jnp.bfloat16 if name in MATMUL_LEAVES else jnp.float32), name
    assert {"embed", "wq", "w_down"} <= MATMUL_LEAVES and "attn_norm" not in MATMUL_LEAVES
    assert "router" not in MATMUL_LEAVES  # the experts' choice stays a float32 dot
    assert cast_matrices(weights, "float32") is weights  # the matrices' dtype already: unchanged


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_dense_matrices_and_embedding(tiny, kind):
    """--weight-dtype int8 / int4: the dense matrices and the embedding become Int8Matrix (a scale per output row)
    or Int4Matrix (a scale and a minimum per 32 weights of a row; the embedding stays int8), [out, in]; the norms
    stay float32; casting them again is refused."""
    cfg, weights, _ = tiny
    q = cast_matrices(weights, kind)
    assert matrices_dtype(q) == kind
    for name, leaf in _leaves(q).items():
        if leaf is None:
            continue
        cls = Int8Matrix if kind == "int8" or name in TOP_MATRICES else Int4Matrix  # int4 keeps the top int8
        assert isinstance(leaf, cls) == (name in QUANTIZED_LEAVES), name
        if name not in QUANTIZED_LEAVES:
            assert leaf.dtype == jnp.float32, name
    wq = q.layers.wq
    assert wq.shape == (cfg.num_layers, cfg.q_size, cfg.hidden_size)
    assert wq.scale.shape == (wq.shape[:2] if kind == "int8" else wq.shape[:2] + (cfg.hidden_size // 32, 2))
    np.testing.assert_allclose(
        np.asarray(dequantized(wq))[0],
        np.asarray(weights.layers.wq[0]).T,
        atol=float(np.asarray(wq.scale).max()) / 2 + 1e-6,
    )
    with pytest.raises(ValueError, match=f"{kind} matrices cannot be cast"):
        cast_matrices(q, "bfloat16")


def _grouped(w):
    """A float32 [.., out, in] matrix as Q8_0's int8 with a scale per 32 (gguf's quantizer, the loader's reading)."""
    import gguf

    return int8_from_q8_0(gguf.quants.quantize(np.asarray(w, np.float32), gguf.GGMLQuantizationType.Q8_0))


def _is_quantized(leaf):
    return isinstance(leaf, (Int8Matrix, Int4Matrix))


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8", "int4", "int8g"])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_native_logits_equal_xla_over_the_same_weights(rows, kind):
    """The native forward (model/native.py: panels through kernels/cpu_matmul.cc, norms summed in a fixed order)
    against XLA's forward over the same weights: equal up to float32 summation order (float32), bf16 rounding of x
    (bfloat16: both round x), x's int8 rounding per group of 32 (integer kinds; XLA widens the weights to bf16), and
    within 5% of the float32 model's logits (int8, int8g: a Q8_0 file's scales per 32, the embedding included)."""
    cfg = TINY_LLAMA.replace(tie_word_embeddings=True)
    weights = dummy_weights(cfg, seed=5)
    q = cast_matrices(weights, "int8" if kind == "int8g" else kind)
    if kind == "int8g":
        nk = dataclasses.replace(weights, layers=jax.tree.map(lambda a: jnp.swapaxes(a, -1, -2), weights.layers))
        q = jax.tree.map(lambda a, w: _grouped(w) if _is_quantized(a) else a, q, nk, is_leaf=_is_quantized)
        assert q.embed.grouped and q.layers.wq.scale.shape == q.layers.wq.shape[:2] + (cfg.hidden_size // 32,)
    packed = pack_weights(q)
    assert isinstance(packed.layers.wq, PackedMatrix) and isinstance(packed.embed, PackedMatrix)
    batch = build_batch(
        [list(range(3, 3 + rows))], [rows], [[1, 2, 3]], 16, rows, 1, 3, logits_rows=list(range(rows)), num_logits=rows
    )
    attend = get_backend("ref")
    logits = []
    for w, ops in ((packed, NATIVE), (q, None), (weights, None)):
        pool = allocate_pool(cfg.num_layers, 4, 16, cfg.num_kv_heads, cfg.head_dim)
        kw = {} if ops is None else {"ops": ops}
        out, _ = jax.jit(lambda w, pool, b, kw=kw: forward(w, pool, b, cfg=cfg, attention=attend, **kw))(
            w, pool, jax.tree.map(jnp.asarray, batch)
        )
        logits.append(np.asarray(out))
    got, xla, model = logits

    def error(ref):
        return (np.linalg.norm(got - ref, axis=-1) / np.linalg.norm(ref, axis=-1)).max()

    assert np.isfinite(got).all() and got.shape == xla.shape
    assert error(xla) < {"float32": 1e-5, "bfloat16": 1e-2}.get(kind, 0.05), error(xla)
    assert (got.argmax(-1) == xla.argmax(-1)).mean() >= 0.8
    if kind in ("int8", "int8g"):
        assert error(model) < 0.06


@pytest.mark.parametrize("kind", ["bfloat16", "int8", "int4"])
def test_engine_reports_and_decodes_with_narrow_matrices(tiny, kind):
    """An engine with bf16, int8 or int4 matrices: the server info names them and the native kernel, the weights
    are packed panels; greedy tokens close to float32's (int4 moves a random tiny model's argmaxes: its text is
    checked on SmolLM2 below)."""
    prompts = [[5, 9, 27, 101, 3], list(range(200, 231))]
    runs = {}
    for weight_dtype in ("float32", kind):
        with tiny_engine(tiny, weight_dtype=weight_dtype) as eng:
            runs[weight_dtype] = eng.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
            info = eng.get_server_info()
            packed = isinstance(eng.runner.weights.layers.wq, PackedMatrix)
        assert info["weight_dtype"] == weight_dtype and info["dtype"] == "float32"
        assert packed == (info["matmul"] == "native")
    if kind != "int4":
        for a, b in zip(runs["float32"], runs[kind]):
            # the first token comes from the same prompt in both runs: its logprob differs by the rounding only
            first_a, first_b = a["meta_info"]["output_token_logprobs"][0], b["meta_info"]["output_token_logprobs"][0]
            if first_a[1] == first_b[1]:
                assert abs(first_a[0] - first_b[0]) < (0.05 if kind == "bfloat16" else 0.1)
            assert sum(x == y for x, y in zip(a["output_ids"], b["output_ids"])) >= 3


def test_auto_keeps_weights_handed_in(tiny):
    cfg, weights, _ = tiny
    with Engine.from_weights(cfg, cast_matrices(weights, "bfloat16"), None, **SMALL) as eng:  # auto: as given
        assert eng.get_server_info()["weight_dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="dtype 'bfloat16': the model is loaded in float32"):
        Engine.from_weights(cfg, weights, None, dtype="bfloat16", **SMALL)


def test_block_dtype_of_gguf_files(tmp_path, smollm2_q8_0_path, smollm2_q4_0_path):
    (tmp_path / "config.json").write_text("{}")
    assert loading.block_dtype(None) == "int4" and loading.block_dtype(smollm2_q8_0_path) == "int8"
    assert loading.block_dtype(smollm2_q4_0_path) == "int4"
    assert loading.block_dtype(str(tmp_path)) is None and loading.block_dtype("/no/such.gguf") is None


def test_real_smollm2_bf16_greedy_text_equals_float32(smollm2, smollm2_tokenizer):
    cfg, weights, tok = smollm2
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = {"max_new_tokens": 16, "temperature": 0.0}
    texts = {}
    # auto for a float32 checkpoint on a CPU with bf16 dots: bf16 matrices and a bf16 KV pool (engine/plan.py)
    for weight_dtype, kv in (("float32", "float32"), ("bfloat16", "float32"), ("bfloat16", "bfloat16")):
        with Engine.from_weights(
            cfg, weights, tok, **{**SMALL, "weight_dtype": weight_dtype, "kv_cache_dtype": kv}
        ) as eng:
            texts[weight_dtype, kv] = [o["text"] for o in eng.generate(prompts, sampling_params=params)]
    assert texts["bfloat16", "float32"] == texts["float32", "float32"]
    assert texts["bfloat16", "bfloat16"] == texts["float32", "float32"]
    assert np.asarray(weights.embed).dtype == np.float32  # the shared copy kept


def test_real_smollm2_quantized_greedy_answers(smollm2):
    """The real SmolLM2 with int8 and int4 matrices keeps the greedy answers float32 gives (whose tokens equal HF's,
    test_smollm2): France's capital, and the Fibonacci function's base case (its constant may differ: greedy text
    is where quantization shows first)."""
    cfg, weights, tok = smollm2
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = {"max_new_tokens": 8, "temperature": 0.0}
    for kind in ("int8", "int4"):
        with Engine.from_weights(cfg, weights, tok, **{**SMALL, "weight_dtype": kind}) as eng:
            texts = [o["text"] for o in eng.generate(prompts, sampling_params=params)]
        assert texts[0].startswith(" Paris") and texts[1].startswith("\n    if n == "), (kind, texts)


@pytest.mark.parametrize("blocks,kind", [("Q4_1", "int4"), ("Q8_0", "int8")])
def test_real_smollm2_cpu_auto_engine(smollm2, smollm2_path, smollm2_q8_0_path, blocks, kind):
    """What auto gives the default model (and its Q8_0 copy) here, no setting pinned: the plan engine/plan.py
    resolves for this machine, reported as such (on this CI kind, with int8 and bf16 dots: the file's Q4_1 blocks as
    int4, Q8_0's as int8 with their scales per 32, and a bf16 KV pool); France's capital, and each prompt's first
    token float32's with its logprob within 0.1. Not the whole greedy text: on "def fibonacci(n):" the second
    token's two best candidates lie 0.05 apart under int4."""
    from sgjax.engine.args import ServerArgs
    from sgjax.engine.plan import Machine, resolve

    cfg, weights, tok = smollm2
    path = smollm2_path if blocks == "Q4_1" else smollm2_q8_0_path
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = {"max_new_tokens": 8, "temperature": 0.0}
    with Engine.from_weights(cfg, weights, tok, **{**SMALL, "weight_dtype": "float32"}) as eng:
        want = eng.generate(prompts, sampling_params=params, return_logprob=True)
    expected = resolve(ServerArgs(path, **SMALL), cfg, Machine.here(), block_dtype=loading.block_dtype(path))
    with Engine(path, **SMALL) as eng:
        info = eng.get_server_info()
        got = eng.generate(prompts, sampling_params=params, return_logprob=True)
    assert (info["weight_dtype"], info["kv_cache_dtype"], info["dtype"]) == (
        expected.weight_dtype,
        expected.kv_dtype,
        "float32",
    )
    if Machine.here().has("avx512_vnni", "avx512_bf16"):
        assert (expected.weight_dtype, expected.kv_dtype) == (kind, "bfloat16")
    assert got[0]["text"].startswith(" Paris"), got[0]["text"]
    for a, b in zip(want, got):
        (la, ta, _), (lb, tb, _) = (
            a["meta_info"]["output_token_logprobs"][0],
            b["meta_info"]["output_token_logprobs"][0],
        )
        assert ta == tb and abs(la - lb) < 0.1, (a["text"], b["text"], la, lb)


@pytest.mark.parametrize("blocks", ["Q4_1", "Q8_0", "Q4_0"])
def test_real_smollm2_blocks_kept(smollm2, smollm2_path, smollm2_q8_0_path, smollm2_q4_0_path, blocks):
    """The default SmolLM2 file stores its layer matrices as GGUF Q4_1 blocks (32 weights as 4-bit steps above the
    block's minimum, an fp16 step and minimum) and its embedding as Q8_0 (32 int8 and an fp16 scale). Read as they
    are (auto, or --weight-dtype int4 on it: loading.load_model_cached) the int4 and grouped int8 matrices hold the
    file's weights exactly; and so do the int8 ones of its Q8_0 copy and the int4 ones of its Q4_0 copy (a step d
    per 32 weights, each d * (u - 8): (scale, low) = (d, -8 d)). Read as float32, then --weight-dtype int4:
    each group's minimum and step are the block's, up to float32 rounding (a 4-bit grid of its own would be off by
    up to 1/30 of a group's range; bf16 rounds by 1/256 of a weight)."""
    import gguf

    cfg, weights, _ = smollm2
    path, kind = {
        "Q4_1": (smollm2_path, "int4"),
        "Q8_0": (smollm2_q8_0_path, "int8"),
        "Q4_0": (smollm2_q4_0_path, "int4"),
    }[blocks]
    kept_cfg, kept = load_gguf(path, "float32", keep_blocks=True)
    sources = [((kept_cfg, cast_matrices(kept, kind)), 0.0)]  # kept: exact
    if blocks == "Q4_1":  # quantized again: to float32 rounding
        sources.append(((None, cast_matrices(weights, "int4")), 1e-6))
    kept = sources[0][0][1]
    assert kept_cfg == cfg
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}

    def want(name, rows=None):
        t = tensors[name]
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(t.shape[::-1].tolist())  # [out, in]
        return values if rows is None else _unpermute(values, rows)  # llama.cpp's rotary row order, undone

    embed = kept.embed
    if blocks != "Q4_0":  # the Q4_0 copy's embedding is Q4_0 too: int4 keeps the top int8, quantized again
        assert tensors["token_embd.weight"].tensor_type.name == "Q8_0" and isinstance(embed, Int8Matrix)
        assert embed.grouped
        np.testing.assert_array_equal(np.asarray(dequantized(embed)), want("token_embd.weight"))
    for layer in (0, cfg.num_layers - 1):
        for name, field in (("ffn_down", "w_down"), ("ffn_up", "w_up"), ("attn_v", "wv"), ("attn_q", "wq")):
            assert tensors[f"blk.{layer}.{name}.weight"].tensor_type.name == blocks
            w = want(f"blk.{layer}.{name}.weight", cfg.num_heads if name == "attn_q" else None)
            for (_, source), tol in sources:
                m = (
                    getattr(source.layers, field)
                    if isinstance(source.layers, LayerWeights)
                    else getattr(source.layers[layer], field)
                )
                m = type(m)(m.q[layer], m.scale[layer]) if m.q.ndim == 3 else m
                assert isinstance(m, Int4Matrix if kind == "int4" else Int8Matrix)
                err = np.abs(np.asarray(dequantized(m)) - w).max()
                assert err <= tol * np.abs(w).max(), (layer, name, tol, err)
