"""Pre-quantized fp8 HF checkpoints (model/fp8_checkpoint.py): a tiny Llama written in compressed-tensors' fp8
format (e4m3 projections, weight_scale per output row) is read byte for byte, served as fp8 by auto (the plan says
so), and gives the answers of the float checkpoint quantized at load by --quantization fp8, whose quantizer wrote
it. Formats not read are refused by name."""

import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from sgjax.engine.engine import Engine
from sgjax.model.fp8_checkpoint import scheme
from sgjax.model.loader import load_hf_dir
from sgjax.model.quant import Fp8Matrix, quantize_fp8
from tests.model.hf_tiny import write_tiny

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WEIGHTS = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
COMPRESSED_TENSORS = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": WEIGHTS,
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
        }
    },
    "ignore": ["lm_head"],
}
SERVE = dict(dtype="float32", skip_tokenizer_init=True, page_size=4, max_total_tokens=512, max_running_requests=4)


def rewrite(src: str, dst: str, quantization_config: dict) -> dict:
    """src's checkpoint at dst with its projections in e4m3 (a scale per row) and `quantization_config`."""
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump({**config, "quantization_config": quantization_config}, f)
    out, written = {}, {}
    for name, t in load_file(os.path.join(src, "model.safetensors")).items():
        if name.split(".")[-2] in PROJECTIONS:
            m = quantize_fp8(t.float().numpy())
            out[name] = torch.from_numpy(np.asarray(m.q).view(np.uint8).copy()).view(torch.float8_e4m3fn)
            out[name + "_scale"] = torch.from_numpy(np.asarray(m.scale)[:, None].copy())
            written[name] = m
        else:
            out[name] = t
    save_file(out, os.path.join(dst, "model.safetensors"))
    return written


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    src = str(tmp_path_factory.mktemp("float32"))
    write_tiny("llama-gqa4", src)
    dst = str(tmp_path_factory.mktemp("fp8"))
    return src, dst, rewrite(src, dst, COMPRESSED_TENSORS)


def test_the_files_e4m3_bytes_and_scales_are_the_matrices(checkpoints):
    _, dst, written = checkpoints
    cfg, w = load_hf_dir(dst, "float32", keep_fp8=True)
    assert isinstance(w.layers.wq, Fp8Matrix) and isinstance(w.layers.w_down, Fp8Matrix)
    assert not isinstance(w.embed, Fp8Matrix)
    for i in range(cfg.num_layers):
        m = written[f"model.layers.{i}.self_attn.q_proj.weight"]
        np.testing.assert_array_equal(np.asarray(w.layers.wq.q[i]).view(np.uint8), np.asarray(m.q).view(np.uint8))
        np.testing.assert_array_equal(np.asarray(w.layers.wq.scale[i]), np.asarray(m.scale))
    # not kept: widened to q * scale, in our [in, out] layout
    _, widened = load_hf_dir(dst, "float32")
    m = written["model.layers.1.mlp.down_proj.weight"]
    np.testing.assert_array_equal(np.asarray(widened.layers.w_down[1]), np.asarray(m.widened(np.float32)).T)


def test_served_as_fp8_with_the_answers_of_quantizing_at_load(checkpoints):
    src, dst, _ = checkpoints
    prompts = [[5, 9, 27, 101, 3], list(range(40, 71)), list(range(100, 140, 3))]
    params = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    runs = []
    for path, extra in ((dst, {}), (src, {"quantization": "fp8"})):
        with Engine(path, **SERVE, **extra) as eng:
            plan = eng.get_server_info()["step_plan"]
            runs.append(eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True))
        assert plan["weight_dtype"] == "fp8"
        if not extra:
            assert "weight_dtype=fp8 (the checkpoint's own fp8 matrices)" in plan["auto"]
    for a, b in zip(*runs):
        assert a["output_ids"] == b["output_ids"]
        # the load-time quantizer runs in XLA, whose float32 division may round a scale an ulp off numpy's
        lp_a, lp_b = ([lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]] for r in (a, b))
        np.testing.assert_allclose(lp_a, lp_b, atol=1e-4)


@pytest.mark.parametrize(
    "config, message",
    [
        ({**COMPRESSED_TENSORS, "config_groups": {"g": {"weights": {**WEIGHTS, "strategy": "group"}}}}, "'group'"),
        (
            {**COMPRESSED_TENSORS, "config_groups": {"g": {"weights": {**WEIGHTS, "strategy": "block"}}}},
            "block_structure",
        ),
        ({**COMPRESSED_TENSORS, "config_groups": {"g": {"weights": {**WEIGHTS, "type": "int"}}}}, "8-bit float"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "two positive ints"),
        ({"quant_method": "awq", "bits": 4}, "quantization 'awq' is not read"),
    ],
)
def test_formats_not_read_are_refused_by_name(config, message):
    with pytest.raises(ValueError, match=message):
        scheme({"quantization_config": config})


def test_an_engine_refuses_a_checkpoint_it_does_not_read_before_loading(checkpoints, tmp_path):
    src, _, _ = checkpoints
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    with open(tmp_path / "config.json") as f:
        config = json.load(f)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({**config, "quantization_config": {"quant_method": "gptq", "bits": 4}}, f)
    with pytest.raises(ValueError, match="quantization 'gptq' is not read by sgjax"):
        Engine(str(tmp_path), **SERVE)
    assert scheme({"quantization_config": {"quant_method": "fp8"}}) == "tensor"
    assert scheme({}) is None


BLOCK = (24, 32)  # rows x columns per scale: the tiny model's 64- and 16-row matrices end in partial row blocks


def block_quantize(w: np.ndarray, block=BLOCK):
    """numpy's block e4m3 of w [out, in]: a scale per (bn x bk) block (its largest magnitude / 448), q = w / scale."""
    (n, k), (bn, bk) = w.shape, block
    scale = np.ones((-(-n // bn), k // bk), np.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            peak = np.abs(w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]).max()
            scale[i, j] = peak / 448.0 if peak > 0 else 1.0
    per_weight = np.repeat(np.repeat(scale, bn, axis=0)[:n], bk, axis=1)
    q = np.clip(w / per_weight, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return q, scale, q.astype(np.float32) * per_weight


@pytest.fixture(scope="module")
def block_checkpoints(checkpoints, tmp_path_factory):
    """The tiny Llama in the block format (quant_method fp8, weight_block_size, `weight_scale_inv`), and a float32
    checkpoint of exactly its dequantized weights (q * scale)."""
    src = checkpoints[0]
    fp8, ref = str(tmp_path_factory.mktemp("fp8_block")), str(tmp_path_factory.mktemp("dequantized"))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
    for d, extra in ((fp8, {"quantization_config": qc}), (ref, {})):
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump({**config, **extra}, f)
    quantized, dequantized, written = {}, {}, {}
    for name, t in load_file(os.path.join(src, "model.safetensors")).items():
        if name.split(".")[-2] in PROJECTIONS:
            q, scale, back = block_quantize(t.float().numpy())
            quantized[name] = torch.from_numpy(q.view(np.uint8).copy()).view(torch.float8_e4m3fn)
            quantized[name + "_scale_inv"] = torch.from_numpy(scale)
            dequantized[name] = torch.from_numpy(back)
            written[name] = (q, scale, back)
        else:
            quantized[name] = dequantized[name] = t
    save_file(quantized, os.path.join(fp8, "model.safetensors"))
    save_file(dequantized, os.path.join(ref, "model.safetensors"))
    return fp8, ref, written


def test_a_block_scaled_checkpoint_is_read_as_its_blocks(block_checkpoints):
    fp8, _, written = block_checkpoints
    assert scheme({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}) == "block"
    cfg, w = load_hf_dir(fp8, "float32", keep_fp8=True)
    assert isinstance(w.layers.wk, Fp8Matrix) and w.layers.wk.grouped
    for i in range(cfg.num_layers):
        for ours, hf in (("wk", "self_attn.k_proj"), ("w_down", "mlp.down_proj"), ("wq", "self_attn.q_proj")):
            q, scale, back = written[f"model.layers.{i}.{hf}.weight"]
            m = getattr(w.layers, ours)
            np.testing.assert_array_equal(np.asarray(m.q[i]).view(np.uint8), q.view(np.uint8))
            # each row keeps its row block's scales, one per BLOCK[1] columns
            np.testing.assert_array_equal(np.asarray(m.scale[i]), np.repeat(scale, BLOCK[0], axis=0)[: q.shape[0]])
            np.testing.assert_array_equal(np.asarray(Fp8Matrix(m.q[i], m.scale[i]).widened(np.float32)), back)


def test_a_block_scaled_checkpoint_serves_its_dequantized_weights_answers(block_checkpoints):
    """auto serves the blocks as fp8 (no round trip through bf16), with the answers of a float32 checkpoint holding
    exactly q * scale; w8a8, which takes row scales, is refused by name."""
    fp8, ref, _ = block_checkpoints
    prompts = [[5, 9, 27, 101, 3], list(range(40, 71)), list(range(100, 140, 3))]
    params = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    runs = []
    for path in (fp8, ref):
        with Engine(path, **SERVE) as eng:
            assert eng.get_server_info()["step_plan"]["weight_dtype"] == ("fp8" if path == fp8 else "float32")
            runs.append(eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True))
    for a, b in zip(*runs):
        assert a["output_ids"] == b["output_ids"]
        lp_a, lp_b = ([lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]] for r in (a, b))
        np.testing.assert_allclose(lp_a, lp_b, atol=1e-5)
    with pytest.raises(ValueError, match="w8a8_fp8.*block-scaled"):
        Engine(fp8, **SERVE, quantization="w8a8_fp8")
