"""bf16 matrices under float32 activations (--weight-dtype, model/config.weight_dtype): which leaves are cast, the
unrolled layer loop they take on the CPU, the tiny model's logprobs against float32, the setting's values, and the
real SmolLM2's greedy text against its float32 run."""

import dataclasses
from contextlib import nullcontext

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgjax.cli import build_parser, split_args
from sgjax.engine import loading
from sgjax.engine.args import ServerArgs
from sgjax.engine.engine import Engine
from sgjax.engine.programs import CallsStep, FewRowsStep, jitted_step
from sgjax.kernels import cpu
from sgjax.model.config import ModelConfig
from sgjax.kernels import allocate_pool, get_backend
from sgjax.model.batch import build_batch
from sgjax.model import llama
from sgjax.model.llama import forward
from sgjax.model.loader import _unpermute, load_gguf
from sgjax.model.presets import TINY_LLAMA
from sgjax.model.quant import Int4Matrix, Int8Matrix, dequantized, int8_from_q8_0
from sgjax.model.weights import (INT8_LEAVES, MATMUL_LEAVES, NK_LEAVES, TOP_MATRICES, LayerWeights, dummy_weights,
                                 layer_loop_for, prepare, unstack_layers, with_matrix_layout, with_weight_dtype)
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
    cast_cfg, cast = with_weight_dtype(cfg, weights, "bfloat16")
    assert cast_cfg.weight_dtype == "bfloat16" and cast_cfg.dtype == "float32"
    for name, leaf in _leaves(cast).items():
        if leaf is not None:
            assert leaf.dtype == (jnp.bfloat16 if name in MATMUL_LEAVES else jnp.float32), name
    assert {"embed", "wq", "w_down"} <= MATMUL_LEAVES and "attn_norm" not in MATMUL_LEAVES
    assert "router" not in MATMUL_LEAVES  # the experts' choice stays a float32 dot
    assert with_weight_dtype(cfg, weights, "float32") == (cfg, weights)  # the model's dtype: unchanged
    assert layer_loop_for("cpu", cast_cfg) == "calls" and layer_loop_for("cpu", cfg) == "scan"
    assert layer_loop_for("gpu", cast_cfg) == layer_loop_for("gpu", cfg) == "unrolled"
    with pytest.raises(ValueError, match="weight_dtype"):
        cfg.replace(weight_dtype="float16")


@pytest.mark.parametrize("unrolled", [False, True], ids=["stacked", "unrolled"])
def test_matrix_layout_transposes_the_dense_matrices_only(tiny, unrolled):
    cfg, weights, _ = tiny
    weights = unstack_layers(weights) if unrolled else weights
    nk_cfg, nk = with_matrix_layout(cfg, weights, "nk")
    assert nk_cfg.matrix_layout == "nk" and {"wq", "wo", "w_gate", "w_down", "lm_head"} <= NK_LEAVES
    assert not {"embed", "router", "we_gate", "attn_norm"} & NK_LEAVES  # embed is [V, D] already
    for name, leaf in _leaves(nk).items():
        before = _leaves(weights)[name]
        if leaf is not None:
            expected = before.shape[:-2] + before.shape[-2:][::-1] if name in NK_LEAVES else before.shape
            assert leaf.shape == expected, name
    back_cfg, back = with_matrix_layout(nk_cfg, nk, "kn")
    assert back_cfg == cfg and jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), back, weights))
    with pytest.raises(ValueError, match="matrix_layout"):
        cfg.replace(matrix_layout="mn")


@pytest.mark.parametrize("rows", [1, 7, 12])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "lm_head"])
def test_bf16_matrices_stored_out_in_give_the_same_logits(rows, tied):
    """What a CPU runs for bf16 matrices (model/weights.prepare: unrolled, [out, in]; one row computed as two)
    against the same bf16 matrices as [in, out]: the same products up to float32 summation order."""
    cfg = TINY_LLAMA.replace(tie_word_embeddings=tied)
    cast_cfg, cast = with_weight_dtype(cfg, dummy_weights(cfg, seed=3), "bfloat16")
    run_cfg, run_weights = prepare(cast_cfg, cast, "cpu")
    assert run_cfg.matrix_layout == "nk" and isinstance(run_weights.layers, tuple)
    assert prepare(cfg, dummy_weights(cfg), "cpu")[0].matrix_layout == "kn"  # float32 matrices stay [in, out]
    batch = build_batch([list(range(3, 3 + rows))], [rows], [[1, 2]], 16, rows, 1, 2, logits_rows=list(range(rows)),
                        num_logits=rows)
    attend = get_backend("ref")
    logits = {}
    for name, (c, w) in {"kn": (cast_cfg, unstack_layers(cast)), "nk": (run_cfg, run_weights)}.items():
        pool = allocate_pool(c.num_layers, 3, 16, c.num_kv_heads, c.head_dim)
        out, _ = jax.jit(lambda w, pool, b, c=c: forward(w, pool, b, cfg=c, attention=attend))(
            w, pool, jax.tree.map(jnp.asarray, batch))
        logits[name] = np.asarray(out)
    assert logits["nk"].shape == (rows, cfg.vocab_size)
    np.testing.assert_allclose(logits["nk"], logits["kn"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("amx", [True, False], ids=["amx-if-here", "no-amx"])
def test_bf16_step_precompiles_and_equals_xla_dots(tiny, amx, monkeypatch):
    """bf16 matrices on a CPU: with AMX every step is one program scanning the per-layer matrices through the
    native kernel; without (here the kernel's vector loop, and the step built as on such a CPU), a step of at most
    llama.NATIVE_ROWS rows is, a larger one host calls (engine/programs.FewRowsStep). Precompiling a shape compiles
    what its run needs (a run compiles nothing after), and each step gives the tokens and logprobs of one jitted
    program of XLA's dots over the same weights."""
    compiled = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: compiled.append(kw.get("fun_name"))
        if event == "/jax/core/compile/backend_compile_duration" else None)
    with tiny_engine(tiny, weight_dtype="bfloat16") as eng, cpu.use_amx(amx) if cpu.available() else nullcontext():
        runner = eng.runner
        if not amx:
            monkeypatch.setattr(cpu, "has_amx", lambda arch="native": False)
            # a step of its own (jitted_step's cache holds this CPU's); the runner's back at the end
            runner.step = jitted_step.__wrapped__(runner.cfg, runner.attention, None, runner.moe_kernel, calls=True)
        one_row = runner.start_shapes(64)[0]  # a decode step of one request; then a 32-token prefill of it
        shapes = [one_row, dataclasses.replace(one_row, batch=dataclasses.replace(one_row.batch, num_tokens=32))]
        step = runner.step
        if cpu.has_amx():
            assert llama.native_rows(runner.cfg) == llama.EVERY_ROW and not isinstance(step, (FewRowsStep, CallsStep))
        elif cpu.available():
            assert isinstance(step, FewRowsStep) and step.rows == llama.NATIVE_ROWS["bfloat16"] > 0
            assert {step.part(s) is step.one for s in shapes} == {True, False}  # decode's and prefill's shapes
        runner.precompile(shapes)
        compiled.clear()
        for shape in shapes:
            runner.run_dummy(shape)
        jax.block_until_ready(runner.state.pool)
        assert compiled == []
        xla = jitted_step(runner.cfg.replace(matmul="xla"), runner.attention, None, "xla", calls=False)
        for shape in shapes:
            buffer = jnp.asarray(runner._dummy_buffer(shape))
            outs = []
            for step in (runner.step, xla):
                runner.reset_pool()
                outs.append(step(runner.weights, runner.state, buffer, shape)[0])
            np.testing.assert_array_equal(np.asarray(outs[0].tokens), np.asarray(outs[1].tokens))
            np.testing.assert_allclose(np.asarray(outs[0].logprobs), np.asarray(outs[1].logprobs), atol=1e-4)
        runner.reset_pool()


def test_tiny_model_logprobs_close_to_float32(tiny):
    prompts = [[5, 9, 27, 101, 3], list(range(200, 231))]
    runs = {}
    for weight_dtype in ("float32", "bfloat16"):
        with tiny_engine(tiny, weight_dtype=weight_dtype) as eng:
            outs = eng.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
            info = eng.get_server_info()
            unrolled = isinstance(eng.runner.weights.layers, tuple)
            layout = eng.runner.cfg.matrix_layout
        assert info["weight_dtype"] == weight_dtype and info["dtype"] == "float32"
        assert layout == ("nk" if weight_dtype == "bfloat16" else "kn")
        assert unrolled == (weight_dtype == "bfloat16")  # the CPU's bf16 dots are fast only outside a scan
        runs[weight_dtype] = outs
    for a, b in zip(runs["float32"], runs["bfloat16"]):
        # the first token comes from the same prompt in both runs: its logprob differs by bf16 rounding only
        first_a, first_b = a["meta_info"]["output_token_logprobs"][0], b["meta_info"]["output_token_logprobs"][0]
        if first_a[1] == first_b[1]:
            assert abs(first_a[0] - first_b[0]) < 0.05
        assert sum(x == y for x, y in zip(a["output_ids"], b["output_ids"])) >= 4


def test_auto_is_the_models_dtype_and_the_setting_is_checked(tiny, monkeypatch, tmp_path, smollm2_q8_0_path,
                                                            smollm2_q4_0_path):
    assert loading.default_weight_dtype(ServerArgs(), "float32") == "float32"  # SGJAX_AUTO_BF16=0 (tests/conftest)
    assert loading.default_weight_dtype(ServerArgs(), "bfloat16") == "bfloat16"
    # auto on a CPU with bf16 dot instructions: bf16 matrices for a float32 model on one device, nowhere else;
    # int4 for a Q4_1 GGUF (the default SmolLM2) or a Q4_0 one, int8 for a Q8_0 one, where the CPU has int8 dots
    monkeypatch.setenv(loading.AUTO_BF16_ENV, "1")
    hf_dir = str(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    q8_0 = ServerArgs(model_path=smollm2_q8_0_path)
    for bf16, int8, platform, args, expected in [
            (True, False, "cpu", ServerArgs(), "bfloat16"),
            (True, True, "cpu", ServerArgs(), "int4"),
            (False, True, "cpu", ServerArgs(), "int4"),
            (True, True, "cpu", q8_0, "int8"),
            (True, True, "cpu", ServerArgs(model_path=smollm2_q4_0_path), "int4"),
            (True, False, "cpu", q8_0, "bfloat16"),
            (True, True, "gpu", q8_0, "float32"),
            (True, True, "cpu", ServerArgs(model_path=hf_dir), "bfloat16"),
            (True, True, "cpu", ServerArgs(load_format="dummy"), "bfloat16"),
            (False, False, "cpu", ServerArgs(), "float32"),
            (True, True, "gpu", ServerArgs(), "float32"),
            (True, True, "cpu", ServerArgs(tp_size=2), "float32"),
            (True, True, "cpu", ServerArgs(weight_dtype="float32"), "float32")]:
        monkeypatch.setattr(loading, "cpu_has_bf16_dots", lambda has=bf16: has)
        monkeypatch.setattr(loading, "cpu_has_int8_dots", lambda has=int8: has)
        assert loading.default_weight_dtype(args, "float32", platform) == expected, (bf16, int8, platform, args)
    assert loading.block_dtype(None) == "int4" and loading.block_dtype(smollm2_q8_0_path) == "int8"
    assert loading.block_dtype(hf_dir) is None and loading.block_dtype("/no/such.gguf") is None
    monkeypatch.setenv(loading.AUTO_BF16_ENV, "0")
    assert loading.default_weight_dtype(ServerArgs(), "float32", "cpu") == "float32"
    assert loading.default_weight_dtype(ServerArgs(weight_dtype="bfloat16"), "float32") == "bfloat16"
    with pytest.raises(ValueError, match="weight_dtype"):
        loading.default_weight_dtype(ServerArgs(weight_dtype="float16"), "float32")
    assert loading.default_weight_dtype(ServerArgs(weight_dtype="int8"), "float32") == "int8"
    with pytest.raises(ValueError, match="weight_dtype int8 runs on one device"):
        loading.default_weight_dtype(ServerArgs(weight_dtype="int8", tp_size=2), "float32")
    args, _ = split_args(build_parser().parse_args(["serve", "--weight-dtype", "bfloat16"]))
    assert args.weight_dtype == "bfloat16"
    cfg, weights, _ = tiny
    cast_cfg, cast = with_weight_dtype(cfg, weights, "bfloat16")
    with Engine.from_weights(cast_cfg, cast, None, **SMALL) as eng:  # auto: the weights as given
        assert eng.get_server_info()["weight_dtype"] == "bfloat16"


def test_real_smollm2_bf16_greedy_text_equals_float32(smollm2, smollm2_tokenizer):
    cfg, weights, tok = smollm2
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = {"max_new_tokens": 16, "temperature": 0.0}
    texts = {}
    # the CPU's auto on a machine with bf16 dots: bf16 matrices and a bf16 KV pool (engine/loading.py)
    for weight_dtype, kv in (("float32", "float32"), ("bfloat16", "float32"), ("bfloat16", "bfloat16")):
        with Engine.from_weights(cfg, weights, tok, **{**SMALL, "weight_dtype": weight_dtype,
                                                       "kv_cache_dtype": kv}) as eng:
            texts[weight_dtype, kv] = [o["text"] for o in eng.generate(prompts, sampling_params=params)]
    assert texts["bfloat16", "float32"] == texts["float32", "float32"]
    assert texts["bfloat16", "bfloat16"] == texts["float32", "float32"]
    assert isinstance(cfg, ModelConfig) and np.asarray(weights.embed).dtype == np.float32  # the shared copy kept


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_dense_matrices_and_embedding(tiny, kind):
    """--weight-dtype int8 / int4: the dense matrices and the embedding become Int8Matrix (a scale per output row)
    or Int4Matrix (a scale and a minimum per 32 weights of a row; the embedding stays int8), [out, in]; the norms
    stay float32; a CPU runs them as layer
    calls with the native kernel; casting again is refused."""
    cfg, weights, _ = tiny
    q_cfg, q = with_weight_dtype(cfg, weights, kind)
    assert q_cfg.weight_dtype == kind and q_cfg.matrix_layout == "nk" and q_cfg.dtype == "float32"
    for name, leaf in _leaves(q).items():
        if leaf is None:
            continue
        # int4 keeps the embedding / LM head in int8 (weights.TOP_MATRICES)
        cls = Int8Matrix if kind == "int8" or name in TOP_MATRICES else Int4Matrix
        assert isinstance(leaf, cls) == (name in INT8_LEAVES), name
        if name not in INT8_LEAVES:
            assert leaf.dtype == jnp.float32, name
    wq = q.layers.wq
    assert wq.shape == (cfg.num_layers, cfg.q_size, cfg.hidden_size)
    assert wq.scale.shape == (wq.shape[:2] if kind == "int8" else wq.shape[:2] + (cfg.hidden_size // 32, 2))
    np.testing.assert_allclose(np.asarray(dequantized(wq))[0], np.asarray(weights.layers.wq[0]).T,
                               atol=float(np.asarray(wq.scale).max()) / 2 + 1e-6)
    run_cfg, run = prepare(q_cfg, q, "cpu")
    assert isinstance(run.layers, tuple) and run_cfg.matmul == ("cpu" if cpu.available() else "xla")
    assert prepare(q_cfg, q, "gpu")[0].matmul == "xla"
    with pytest.raises(ValueError, match=kind):
        with_weight_dtype(q_cfg, q, "bfloat16")


def _is_quantized(leaf):
    return isinstance(leaf, (Int8Matrix, Int4Matrix))


def _grouped(w):
    """A float32 [.., out, in] matrix as Q8_0's int8 with a scale per 32 (gguf's quantizer, the loader's reading)."""
    import gguf

    return int8_from_q8_0(gguf.quants.quantize(np.asarray(w, np.float32), gguf.GGMLQuantizationType.Q8_0))


@pytest.mark.parametrize("kind", ["int8", "int4", "int8g"])
@pytest.mark.parametrize("matmul", ["cpu", "xla"])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_quantized_logits_equal_the_widened_weights(rows, matmul, kind):
    """The quantized forward's logits against a float32 forward over the same weights widened (dequantized):
    through the native kernel (rows up to llama.native_rows) they differ by x's int8 rounding per block of 64,
    through XLA's dots (more rows, or matmul "xla") by bf16 rounding; int8's are also within 5% of the float32
    model's own logits (int8g's within 6%). int8g: int8 with a scale per 32 weights (a Q8_0 file's, kept),
    embedding included."""
    cfg = TINY_LLAMA.replace(tie_word_embeddings=True)
    weights = dummy_weights(cfg, seed=5)
    q_cfg, q = with_weight_dtype(cfg, weights, "int8" if kind == "int8g" else kind)
    if kind == "int8g":
        _, nk = with_matrix_layout(cfg, weights, "nk")  # the float32 matrices where q has int8 ones
        q = jax.tree.map(lambda a, w: _grouped(w) if _is_quantized(a) else a, q, nk, is_leaf=_is_quantized)
        assert q.embed.grouped and q.layers.wq.scale.shape == q.layers.wq.shape[:2] + (cfg.hidden_size // 32,)
    q_cfg, q = prepare(q_cfg, q, "cpu")
    q_cfg = q_cfg.replace(matmul=matmul if cpu.available() else "xla")
    wide = jax.tree.map(lambda a: dequantized(a) if _is_quantized(a) else a, q, is_leaf=_is_quantized)
    wide_cfg = q_cfg.replace(weight_dtype=None, matmul="xla")
    batch = build_batch([list(range(3, 3 + rows))], [rows], [[1, 2, 3]], 16, rows, 1, 3,
                        logits_rows=list(range(rows)), num_logits=rows)
    attend = get_backend("ref")
    logits = []
    for c, w in ((q_cfg, q), (wide_cfg, wide), (cfg, weights)):
        pool = allocate_pool(c.num_layers, 4, 16, c.num_kv_heads, c.head_dim)
        out, _ = jax.jit(lambda w, pool, b, c=c: forward(w, pool, b, cfg=c, attention=attend))(
            w, pool, jax.tree.map(jnp.asarray, batch))
        logits.append(np.asarray(out))
    got, widened, model = logits

    def error(ref):
        return (np.linalg.norm(got - ref, axis=-1) / np.linalg.norm(ref, axis=-1)).max()

    assert np.isfinite(got).all() and got.shape == widened.shape
    assert error(widened) < 0.03, error(widened)
    assert (got.argmax(-1) == widened.argmax(-1)).mean() >= 0.8
    if kind in ("int8", "int8g"):  # int8g's weights times their scales are rounded to bf16 in XLA's dots and tiles
        assert error(model) < (0.06 if kind == "int8g" else 0.05)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_engine_decodes_as_one_program_and_reports_it(tiny, kind):
    """An engine with int8 or int4 matrices: server info names them and the native matmul; decode's shapes run as
    one program (every shape where the CPU has AMX; else FewRowsStep's `one`, prefill's as layer calls); greedy
    tokens close to float32's."""
    prompts = [[5, 9, 27, 101, 3], list(range(200, 231))]
    runs = {}
    for weight_dtype in ("float32", kind):
        with tiny_engine(tiny, weight_dtype=weight_dtype) as eng:
            runs[weight_dtype] = eng.generate(input_ids=prompts, sampling_params=GREEDY)
            info = eng.get_server_info()
            step = eng.runner.step
        assert info["weight_dtype"] == weight_dtype
    assert info["matmul"] == ("cpu" if cpu.available() else "xla")
    if cpu.has_amx():  # every step one program (int8 / int4 widened to bf16 tiles past 4 rows)
        assert not isinstance(step, (FewRowsStep, CallsStep)) and llama.native_rows(eng.runner.cfg) == llama.EVERY_ROW
    elif cpu.available():
        assert isinstance(step, FewRowsStep) and step.rows == llama.NATIVE_ROWS[kind]
        assert step.part(eng.runner.start_shapes(64)[0]) is step.one
    if kind == "int8":  # 4 bits move a random tiny model's argmaxes: int4's text is checked on SmolLM2 below
        for a, b in zip(runs["float32"], runs[kind]):
            assert sum(x == y for x, y in zip(a["output_ids"], b["output_ids"])) >= 3


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
def test_real_smollm2_cpu_auto_engine(smollm2, smollm2_path, smollm2_q8_0_path, monkeypatch, blocks, kind):
    """What auto gives the default model (and its Q8_0 copy) on a CPU with bf16 and int8 dots (the tests pin
    float32 otherwise): the file's Q4_1 blocks read as int4 (Q8_0's as int8 with their scales per 32) and a bf16 KV
    pool, reported as such; France's capital, and each prompt's first token float32's with its logprob within 0.1.
    Not the whole greedy text: on "def fibonacci(n):" the second token's two best candidates lie 0.05 apart under
    int4, so float rounding alone (the blocks read as they are or quantized again, a step's padding) picks one or
    the other."""
    cfg, weights, tok = smollm2
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = {"max_new_tokens": 8, "temperature": 0.0}
    with Engine.from_weights(cfg, weights, tok, **{**SMALL, "weight_dtype": "float32"}) as eng:
        want = eng.generate(prompts, sampling_params=params, return_logprob=True)
    monkeypatch.setenv(loading.AUTO_BF16_ENV, "1")
    monkeypatch.setattr(loading, "cpu_has_bf16_dots", lambda: True)
    monkeypatch.setattr(loading, "cpu_has_int8_dots", lambda: True)
    with Engine(smollm2_path if blocks == "Q4_1" else smollm2_q8_0_path, **SMALL) as eng:
        info = eng.get_server_info()
        got = eng.generate(prompts, sampling_params=params, return_logprob=True)
    assert (info["weight_dtype"], info["kv_cache_dtype"], info["dtype"]) == (kind, "bfloat16", "float32")
    assert got[0]["text"].startswith(" Paris"), got[0]["text"]
    for a, b in zip(want, got):
        (la, ta, _), (lb, tb, _) = a["meta_info"]["output_token_logprobs"][0], b["meta_info"]["output_token_logprobs"][0]
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
    path, kind = {"Q4_1": (smollm2_path, "int4"), "Q8_0": (smollm2_q8_0_path, "int8"),
                  "Q4_0": (smollm2_q4_0_path, "int4")}[blocks]
    sources = [(with_weight_dtype(*load_gguf(path, "float32", keep_blocks=True), kind), 0.0)]  # kept: exact
    if blocks == "Q4_1":  # quantized again: to float32 rounding
        sources.append(((None, with_weight_dtype(cfg, weights, "int4")[1]), 1e-6))
    (kept_cfg, kept), _ = sources[0]
    assert kept_cfg == dataclasses.replace(cfg, weight_dtype=kind, matrix_layout="nk")
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
                m = getattr(source.layers, field) if isinstance(source.layers, LayerWeights) else getattr(
                    source.layers[layer], field)
                m = type(m)(m.q[layer], m.scale[layer]) if m.q.ndim == 3 else m
                assert isinstance(m, Int4Matrix if kind == "int4" else Int8Matrix)
                err = np.abs(np.asarray(dequantized(m)) - w).max()
                assert err <= tol * np.abs(w).max(), (layer, name, tol, err)
