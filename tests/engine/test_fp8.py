"""--quantization fp8 (weights e4m3 with a scale per output row, quantized at load; w8a16, or w8a8 with the
activations in e4m3 per token; under tensor parallelism too) and --kv-cache-dtype fp8: the quantizers against numpy
references, which leaves they take, the plan and the flag's table, and the engine's answers against bf16 / a
float32 pool / one device on the tiny model and the real SmolLM2 (the fp8 pool's kernels:
tests/kernels/test_fp8_pool.py)."""

import dataclasses
import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from sgjax.engine import mesh as tp
from sgjax.engine.args import ServerArgs
from sgjax.engine.engine import Engine
from sgjax.engine.plan import Machine, resolve
from sgjax.model import kv_scales
from sgjax.model.quant import E4M3_MAX, Fp8Matrix, quantize_fp8, w8a8_dot
from sgjax.model.weights import DENSE_LEAVES, TOP_MATRICES, cast_matrices, matrices_dtype
from tests.conftest import SMALL
from tests.engine.conftest import tiny_engine

FP8_POOL = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def e4m3_grid() -> np.ndarray:
    """Every finite float8_e4m3fn value, as float32."""
    every = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return np.unique(every[np.isfinite(every)])


def test_quantizer_rounds_each_row_to_the_nearest_e4m3_step_of_its_scale():
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.02, (3, 8, 64)).astype(np.float32) * rng.uniform(0.1, 10, (3, 8, 1)).astype(np.float32)
    w[1, 2] = 0.0  # a row of zeros: scale 1, not 0/0
    m = quantize_fp8(w)
    assert m.q.dtype == ml_dtypes.float8_e4m3fn and m.scale.shape == (3, 8) and m.scale.dtype == np.float32
    peak = np.abs(w).max(axis=-1)
    np.testing.assert_allclose(m.scale, np.where(peak > 0, peak / E4M3_MAX, 1.0), rtol=1e-6)
    # the reference: the nearest grid value of w / scale (ties aside), found by brute force
    grid = e4m3_grid()
    x = w / m.scale[..., None]
    nearest = grid[np.abs(x[..., None] - grid).argmin(axis=-1)]
    q = m.q.astype(np.float32)
    assert (np.abs(q - x) <= np.abs(nearest - x) + 1e-6).all()
    # each row's largest magnitude is exactly the top of the range; nothing saturates past it
    assert np.allclose(np.abs(q).max(axis=-1)[peak > 0], E4M3_MAX) and np.isfinite(q).all()
    # the round trip: within half a step of e4m3 (3 mantissa bits: 1/16 relative), or the subnormal step
    back = np.asarray(m.widened())
    bound = np.maximum(np.abs(w) / 16, m.scale[..., None] * 2.0**-10)
    assert (np.abs(back - w) <= bound + 1e-12).all()
    assert (back[1, 2] == 0).all()


def test_saturation_at_the_top_of_the_range():
    w = np.array([[1.0, -1.0, 0.5, 1.0 - 1e-7, 3e-3]], np.float32)
    m = quantize_fp8(w)
    assert float(m.scale[0]) == pytest.approx(1 / E4M3_MAX)
    assert np.asarray(m.q.astype(np.float32))[0, :2].tolist() == [E4M3_MAX, -E4M3_MAX]


def test_the_layers_projections_are_quantized_the_embedding_and_head_kept(tiny):
    cfg, weights, _ = tiny
    cast = cast_matrices(weights, "fp8")
    assert matrices_dtype(cast) == "fp8"
    for name in DENSE_LEAVES - TOP_MATRICES:
        leaf = getattr(cast.layers, name, None)
        if leaf is not None:
            assert isinstance(leaf, Fp8Matrix) and leaf.shape == getattr(weights.layers, name).shape[:-2] + (
                getattr(weights.layers, name).shape[-1],
                getattr(weights.layers, name).shape[-2],
            ), name
    assert cast.embed is weights.embed  # as loaded (SGLang's fp8 keeps the embedding and the head too)


def test_the_quantization_flag_picks_the_matrices_and_refuses_the_rest(tiny):
    cfg, _, _ = tiny
    here = Machine.here()
    assert resolve(ServerArgs(quantization="fp8"), cfg, here).weight_dtype == "fp8"
    assert resolve(ServerArgs(quantization="w8a16_int8"), cfg, here).weight_dtype == "int8"
    with pytest.raises(ValueError, match="quantization 'awq' is not built"):
        resolve(ServerArgs(quantization="awq"), cfg, here)
    with pytest.raises(ValueError, match="disagree"):
        resolve(ServerArgs(quantization="fp8", weight_dtype="int4"), cfg, here)
    with pytest.raises(ValueError, match="runs on one device"):
        resolve(ServerArgs(quantization="w8a16_int8", tp_size=2), cfg, here)
    assert resolve(ServerArgs(quantization="fp8", tp_size=2), cfg, here).weight_dtype == "fp8"


def test_w8a8_product_quantizes_each_row_and_equals_numpys():
    """w8a8_dot: each row of h to e4m3 with its own scale (largest magnitude / 448), both operands fp8, float32
    accumulation, scaled back by the row's and the output channel's scales; a row's result is the same alone."""
    rng = np.random.default_rng(1)
    h = (rng.normal(0, 1, (5, 64)) * rng.uniform(0.01, 30, (5, 1))).astype(np.float32)
    h[3] = 0.0  # a row of zeros: scale 1, output 0
    w = quantize_fp8(rng.normal(0, 0.05, (24, 64)).astype(np.float32))
    out = np.asarray(w8a8_dot(jnp.asarray(h), Fp8Matrix(jnp.asarray(w.q), jnp.asarray(w.scale)), jnp.float32))
    peak = np.abs(h).max(axis=-1, keepdims=True)
    xs = np.where(peak > 0, peak / E4M3_MAX, 1.0)
    xq = (h / xs).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)  # ml_dtypes rounds to nearest even
    want = (xq @ w.q.astype(np.float32).T) * xs * w.scale
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    assert (out[3] == 0).all()
    exact = h @ w.widened().T  # w8a16's product: w8a8 adds only the activations' rounding (1/16 at most)
    assert np.abs(out - exact).max() <= 0.1 * np.abs(exact).max()
    alone = np.asarray(w8a8_dot(jnp.asarray(h[1:2]), Fp8Matrix(jnp.asarray(w.q), jnp.asarray(w.scale)), jnp.float32))
    np.testing.assert_allclose(alone[0], out[1], rtol=1e-6)


def test_w8a8_only_where_asked(tiny):
    """--quantization fp8 is w8a16 everywhere (on a GPU with fp8 dots too, where it says why: our w8a8 decodes
    slower there); w8a8_fp8 asks for activations in e4m3; --weight-dtype fp8 is weights only. The step's program
    differs."""
    cfg, _, _ = tiny
    bf16 = cfg.replace(dtype="bfloat16")
    hopper, ampere = Machine("gpu", fp8_dots=True), Machine("gpu")
    on_hopper = resolve(ServerArgs(quantization="fp8"), bf16, hopper)
    assert not on_hopper.fp8_activations and any("w8a16" in a for a in on_hopper.auto)
    assert resolve(ServerArgs(quantization="w8a8_fp8"), bf16, hopper).fp8_activations
    assert not resolve(ServerArgs(quantization="fp8"), bf16, ampere).fp8_activations
    assert not resolve(ServerArgs(weight_dtype="fp8"), bf16, hopper).fp8_activations
    assert not resolve(ServerArgs(quantization="w8a16_int8"), bf16, hopper).fp8_activations
    asked = resolve(ServerArgs(quantization="w8a8_fp8"), cfg, Machine.here())
    assert asked.fp8_activations and asked.weight_dtype == "fp8" and not any("fp8_act" in a for a in asked.auto)
    assert asked.program() != resolve(ServerArgs(quantization="fp8"), cfg, Machine.here()).program()


def test_tiny_engine_with_fp8_matrices_stays_close_to_float32(tiny):
    """w8a16 and w8a8 (activations e4m3 per token as well) against float32 matrices."""
    prompts = [[5, 9, 27, 101, 3], list(range(200, 231)), list(range(1000, 1040, 3))]
    greedy = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    runs = {}
    for quantization in (None, "fp8", "w8a8_fp8"):
        with tiny_engine(tiny, quantization=quantization) as eng:
            runs[quantization] = eng.generate(input_ids=prompts, sampling_params=greedy, return_logprob=True)
            plan = eng.get_server_info()["step_plan"]
            assert plan["weight_dtype"] == ("fp8" if quantization else "float32")
            assert plan["fp8_activations"] == (quantization == "w8a8_fp8")
    for quantization, bound in (("fp8", 0.15), ("w8a8_fp8", 0.25)):
        for a, b in zip(runs[None], runs[quantization]):
            (lp_a, tok_a, _), (lp_b, tok_b, _) = (
                a["meta_info"]["output_token_logprobs"][0],
                b["meta_info"]["output_token_logprobs"][0],
            )
            if tok_a == tok_b:  # the first token comes from the same prompt: its logprob differs by the rounding
                assert abs(lp_a - lp_b) < bound, quantization
            assert sum(x == y for x, y in zip(a["output_ids"], b["output_ids"])) >= 3, quantization


def test_real_smollm2_fp8_keeps_the_greedy_answers(smollm2):
    cfg, weights, tok = smollm2
    prompts = ["The capital of France is", "def fibonacci(n):"]
    with Engine.from_weights(cfg, weights, tok, **{**SMALL, "quantization": "fp8"}) as eng:
        texts = [o["text"] for o in eng.generate(prompts, sampling_params={"max_new_tokens": 8, "temperature": 0})]
    assert texts[0].startswith(" Paris") and texts[1].startswith("\n    if n == "), texts


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_tiny_engine_with_an_fp8_kv_cache_stays_close_to_float32(tiny, kv):
    """--kv-cache-dtype fp8: the pool stores fp8 (the plan says so), and every prompt token's logprob (each read
    over the fp8 keys and values before it) stays near a float32 pool's under the same attention backend: cpu (the
    CPU's default, the native kernel) and ref. The two backends' fp8 runs agree to float32 rounding: the kernel
    writes the bytes ref's writer does and reads them alike. The tiny random model's near-flat logits make its
    greedy tokens a poor judge."""
    prompts = [[5, 9, 27, 101, 3, 77, 12], list(range(200, 231)), list(range(1000, 1040, 3))]
    params = {"max_new_tokens": 1, "temperature": 0.0}
    logprobs = {}
    for backend in ("cpu", "ref"):
        for pool in ("auto", kv):
            with tiny_engine(tiny, attention_backend=backend, kv_cache_dtype=pool) as eng:
                outs = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True, logprob_start_len=0)
                logprobs[backend, pool] = np.array(
                    [lp for o in outs for lp, _, _ in o["meta_info"]["input_token_logprobs"][1:]]
                )
                plan = eng.get_server_info()["step_plan"]
                assert (plan["kv_dtype"], plan["attention"]) == (FP8_POOL.get(pool, "float32"), backend)
        diff = np.abs(logprobs[backend, "auto"] - logprobs[backend, kv])
        bound = {"fp8_e4m3": 1, "fp8_e5m2": 2}[kv]  # e5m2 keeps a mantissa bit less
        assert 0 < diff.mean() < 0.06 * bound and diff.max() < 0.3 * bound, (backend, diff.mean(), diff.max())
    np.testing.assert_allclose(logprobs["cpu", kv], logprobs["ref", kv], atol=2e-5)  # 2e-6 apart here


def test_real_smollm2_fp8_kv_cache_keeps_the_greedy_answers(smollm2, smollm2_path, tmp_path):
    """Unscaled, and with scales `sgjax kv-scales` measured on the real model (its command line, a prompts file)."""
    from sgjax.cli import main

    cfg, weights, tok = smollm2
    lines, out = tmp_path / "prompts.txt", tmp_path / "scales.json"
    lines.write_text("Tell me about Paris.\nWrite a Python function.\nWhat is 2 + 2?\n")
    main(["kv-scales", "--model-path", smollm2_path, "--prompts-file", str(lines), "--out", str(out)])
    scales = kv_scales.from_json(str(out), "float8_e4m3fn", cfg.num_layers, cfg.num_kv_heads)
    assert len(scales.k) == cfg.num_layers and all(0 < s < 1 for s in scales.k)  # keys well under 448
    prompts = ["The capital of France is", "def fibonacci(n):"]
    for extra in ({}, {"quantization_param_path": str(out)}):
        with Engine.from_weights(cfg, weights, tok, **{**SMALL, "kv_cache_dtype": "fp8_e4m3", **extra}) as eng:
            assert eng.get_server_info()["step_plan"]["kv_dtype"] == "float8_e4m3fn"
            texts = [o["text"] for o in eng.generate(prompts, sampling_params={"max_new_tokens": 8, "temperature": 0})]
        assert texts[0].startswith(" Paris") and texts[1].startswith("\n    if n == "), texts


def test_tensor_parallel_fp8_equals_one_device(tiny):
    """--quantization fp8 under TP=2 (CPU host devices): each device holds its half of every sharded e4m3 matrix
    with its rows' scales beside them, and the engine's answers equal one device's."""
    from tests.engine.test_tp import assert_same, workload

    runs = {}
    for tp_size in (1, 2):
        # a float32 pool on both: auto narrows one device's pool to bf16 beside narrowed matrices
        with tiny_engine(tiny, quantization="fp8", kv_cache_dtype="float32", tp_size=tp_size) as eng:
            wq = eng.runner.weights.layers.wq
            assert isinstance(wq, Fp8Matrix)
            if tp_size == 2:  # q [L, out, in] split on its output rows, the scale [L, out] likewise
                assert wq.q.sharding.shard_shape(wq.q.shape)[1] == wq.q.shape[1] // 2
                assert wq.scale.sharding.shard_shape(wq.scale.shape)[1] == wq.scale.shape[1] // 2
                w_o = eng.runner.weights.layers.wo  # row-parallel: split on its input axis, scales whole
                assert w_o.q.sharding.shard_shape(w_o.q.shape)[2] == w_o.q.shape[2] // 2
                assert w_o.scale.sharding.shard_shape(w_o.scale.shape) == w_o.scale.shape
                # the accelerators' unrolled layers keep each slice's partitioning
                first = tp.unstack_placed(eng.runner.weights, eng.runner.mesh).layers[0].wq
                assert first.q.sharding.shard_shape(first.q.shape)[0] == first.q.shape[0] // 2
            runs[tp_size] = workload(eng)
    assert_same(runs[2], runs[1])


# -- an fp8 pool's scales (model/kv_scales.py) ------------------------------------------------------------------
def rescaled(tiny, which: str, by: float = 1000.0):
    """The tiny model computing the same function with its keys `by` times larger (queries `by` times smaller), or
    its values `by` times smaller (the output projection `by` times larger): in float32 the same logits; in an
    unscaled e4m3 pool the keys saturate at 448, or the values fall below its smallest steps."""
    cfg, w, tok = tiny
    layers = w.layers
    if which == "keys":
        layers = dataclasses.replace(layers, wq=layers.wq / by, wk=layers.wk * by)
    else:
        layers = dataclasses.replace(layers, wv=layers.wv / by, wo=layers.wo * by)
    return cfg, dataclasses.replace(w, layers=layers), tok


def prompt_logprobs(eng, prompts):
    outs = eng.generate(
        input_ids=prompts,
        sampling_params={"max_new_tokens": 1, "temperature": 0.0},
        return_logprob=True,
        logprob_start_len=0,
    )
    return np.array([lp for o in outs for lp, _, _ in o["meta_info"]["input_token_logprobs"][1:]])


def test_scaled_attention_equals_unscaled_and_stores_scaled_keys_and_values():
    """kv_scales.scaled around the ref backend over a float32 pool: the same output as the backend alone (the
    scales cancel), the pool holding k / ks and v / vs, per layer and per KV head (query heads take their KV
    head's)."""
    from sgjax.kernels import AttentionMetadata, allocate_pool, ref_attention

    rng = np.random.default_rng(0)
    t, hq, hkv, d, layers = 6, 4, 2, 8, 3
    q, k, v = (jnp.asarray(rng.normal(size=(t, h, d)), jnp.float32) for h in (hq, hkv, hkv))
    meta = AttentionMetadata(  # one request of 6 tokens on pages 1 and 2 (page size 4)
        slot_mapping=jnp.arange(4, 4 + t, dtype=jnp.int32),
        cu_q_lens=jnp.array([0, t], jnp.int32),
        kv_lens=jnp.array([t], jnp.int32),
        page_table=jnp.array([[1, 2]], jnp.int32),
    )
    scales = kv_scales.KvScales(k=(1.0, (0.5, 4.0), 2.0), v=(1.0, (3.0, 0.25), 0.5), source="test")
    pool = allocate_pool(layers, 4, 4, hkv, d)
    want, _ = ref_attention(q, k, v, pool, 1, meta, sm_scale=0.3)
    got, pool = kv_scales.scaled(ref_attention, scales)(q, k, v, pool, jnp.int32(1), meta, sm_scale=0.3)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    stored = np.asarray(pool[1, 1:3]).reshape(8, 2 * hkv, d)[:t]
    np.testing.assert_allclose(stored[:, 0::2], np.asarray(k) / np.array([0.5, 4.0])[None, :, None], rtol=1e-6)
    np.testing.assert_allclose(stored[:, 1::2], np.asarray(v) / np.array([3.0, 0.25])[None, :, None], rtol=1e-6)


def test_kv_scales_file_is_read_and_checked(tmp_path):
    def write(doc):
        path = tmp_path / "scales.json"
        path.write_text(json.dumps(doc))
        return str(path)

    doc = {"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": {"0": 0.5, "1": 2.0}}}}
    s = kv_scales.from_json(write(doc), "float8_e4m3fn", num_layers=2, num_kv_heads=4)
    assert s.k == s.v == (0.5, 2.0)
    np.testing.assert_array_equal(s.tables(4)[0], [[0.5] * 4, [2.0] * 4])
    # one set per TP rank: each rank's KV heads take its scales
    ranks = {"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": {"0": 1.0}, "1": {"0": 3.0}}}}
    s = kv_scales.from_json(write(ranks), "float8_e4m3fn", num_layers=1, num_kv_heads=4, tp_size=2)
    np.testing.assert_array_equal(s.tables(4)[0], [[1.0, 1.0, 3.0, 3.0]])
    np.testing.assert_array_equal(s.tables(8)[1], [[1.0] * 4 + [3.0] * 4])  # KV heads copied for tp 8
    for bad, message in (
        ({**doc, "kv_cache": {**doc["kv_cache"], "dtype": "float8_e5m2"}}, "float8_e5m2 cache"),
        ({"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": {"0": 0.5}}}}, "scales for 1 layers"),
        ({"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": {"0": -1, "1": 1}}}}, "positive"),
        ({"kv_cache": {"dtype": "float8_e4m3fn"}}, "not a KV cache scales file"),
        (ranks, "one TP rank's scales or 1"),
    ):
        with pytest.raises(ValueError, match=message):
            kv_scales.from_json(write(bad), "float8_e4m3fn", num_layers=2, num_kv_heads=4)


@pytest.mark.parametrize("which", ["keys", "values"])
def test_calibrated_scales_keep_an_fp8_pool_close_where_unscaled_it_breaks(tiny, tmp_path, which):
    """Keys 1000x larger, or values 1000x smaller (the same float32 function): an unscaled e4m3 pool saturates the
    keys or loses the values; scales calibrated from a float32 pool of the same prompts (`calibrate`, the file
    --quantization-param-path reads) bring its logprobs back within the unscaled test's bound on the original
    model; the plan names their source. Asking for scales without an fp8 pool is refused by name."""
    model = rescaled(tiny, which)
    prompts = [[5, 9, 27, 101, 3, 77, 12], list(range(200, 231)), list(range(1000, 1040, 3))]
    with tiny_engine(model, attention_backend="ref") as eng:
        reference = prompt_logprobs(eng, prompts)
        doc = eng._call(lambda: kv_scales.calibrate(eng.runner.state.pool, "float8_e4m3fn"))
    path = tmp_path / "scales.json"
    path.write_text(json.dumps(doc))
    diffs = {}
    for name, extra in (("unscaled", {}), ("scaled", {"quantization_param_path": str(path)})):
        with tiny_engine(model, kv_cache_dtype="fp8_e4m3", **extra) as eng:
            diffs[name] = np.abs(prompt_logprobs(eng, prompts) - reference)
            source = eng.get_server_info()["step_plan"]["kv_scales"]
        assert (source is None) == (name == "unscaled"), source
    assert "quantization_param_path scales.json" in source
    # keys: 0.40 unscaled, 0.036 scaled (values: far more unscaled)
    assert diffs["unscaled"].mean() > 0.25, diffs["unscaled"].mean()
    scaled = diffs["scaled"]
    assert scaled.mean() < 0.06 and scaled.max() < 0.3, (scaled.mean(), scaled.max())
    with pytest.raises(ValueError, match="quantization_param_path: KV cache scales need --kv-cache-dtype"):
        tiny_engine(model, quantization_param_path=str(path))


def test_the_checkpoints_own_kv_scales_are_read(tmp_path):
    """An HF directory with `self_attn.k_scale` / `v_scale` tensors (vLLM's names) gives an fp8 pool its scales;
    one layer's missing is refused by name."""
    from safetensors.numpy import load_file, save_file

    from tests.model.hf_tiny import write_tiny

    write_tiny("llama-gqa4", str(tmp_path))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    layers = 3
    for i in range(layers):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = np.float32([0.25 * (i + 1)])
        tensors[f"model.layers.{i}.self_attn.v_scale"] = np.array(0.5, np.float32)  # a 0-d one
    save_file(tensors, str(tmp_path / "model.safetensors"))
    serve = dict(dtype="float32", skip_tokenizer_init=True, page_size=4, max_total_tokens=512, max_running_requests=4)
    with Engine(str(tmp_path), kv_cache_dtype="fp8_e4m3", attention_backend="ref", **serve) as eng:
        plan = eng.get_server_info()["step_plan"]
        out = eng.generate(input_ids=[[5, 9, 27, 101]], sampling_params={"max_new_tokens": 3, "temperature": 0})
    assert plan["kv_scales"] == "checkpoint (3 layers, 0.25 to 0.75)" and len(out[0]["output_ids"]) == 3
    s = kv_scales.from_checkpoint(str(tmp_path), layers, 2)
    assert s.k == (0.25, 0.5, 0.75) and s.v == (0.5,) * 3
    del tensors["model.layers.2.self_attn.v_scale"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="KV cache scales are incomplete"):
        kv_scales.from_checkpoint(str(tmp_path), layers, 2)


def test_tensor_parallel_scaled_fp8_pool_equals_one_device(tiny, tmp_path):
    """Each rank's KV heads take their layer's scales. Under ref (as before the cpu kernel read fp8): an fp8 pool turns
    the last-bit differences between one device's products and two devices' into whole e4m3 steps wherever a key
    sits near a rounding tie, which moved a logprob by 5e-5 under ref and by 2.2e-4 under the cpu default (its one
    device step is the batch-invariant one), past assert_same's 2e-4; float32 pools differ by 2e-6 under both."""
    from tests.engine.test_tp import assert_same, workload

    cfg = tiny[0]
    layers = {str(i): 0.05 * (i + 1) for i in range(cfg.num_layers)}
    doc = {"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": layers}}}
    path = tmp_path / "scales.json"
    path.write_text(json.dumps(doc))
    runs = {}
    for tp_size in (1, 2):
        serve = dict(kv_cache_dtype="fp8_e4m3", quantization_param_path=str(path), attention_backend="ref")
        with tiny_engine(tiny, tp_size=tp_size, **serve) as eng:
            runs[tp_size] = workload(eng)
    assert_same(runs[2], runs[1])
