"""Mixtures of experts through the whole engine: greedy tokens equal HF transformers' on tiny random Qwen3-MoE,
Mixtral and OLMoE checkpoints (ragged batches, a cached prefix, chunked prefill); expert parallelism over 2 and 4
CPU host devices (and tensor-parallel experts) gives the one-device tokens with each device holding its share of
the experts; the router's per-expert token counts reach the server info and /metrics; `sgjax serve --ep-size`
answers the official OpenAI client."""

import jax
import numpy as np
import pytest

from sgjax.engine import mesh as tp
from sgjax.engine.engine import Engine
from sgjax.model.loader import load_hf_dir
from sgjax.model.moe import _pallas_fits, default_kernel
from sgjax.server.metrics import Metrics
from tests.model.hf_tiny import MOE_VARIANTS, hf_logits, write_tiny

NEW = 6
# a long prompt (two 24-token prefill chunks), then a batch of which one extends it (its prefix from the cache)
LONG = list(range(40, 80))
ROUND2 = [LONG + [7, 11, 13], list(range(200, 211)), [5, 9, 27]]
ENGINE = dict(max_total_tokens=1024, chunked_prefill_size=24, max_running_requests=4)
GREEDY = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for name in MOE_VARIANTS:
        path = str(tmp_path_factory.mktemp(name))
        hf = write_tiny(name, path)
        out[name] = (hf, *load_hf_dir(path))
    return out


def _hf_greedy(model, prompt):
    ids = list(prompt)
    for _ in range(NEW):
        ids.append(int(np.argmax(hf_logits(model, ids)[-1])))
    return ids[len(prompt) :]


def _run(engine):
    first = engine.generate(input_ids=[LONG], sampling_params=GREEDY, return_logprob=True)
    rest = engine.generate(input_ids=ROUND2, sampling_params=GREEDY, return_logprob=True)
    return first + rest


@pytest.mark.parametrize("name,moe_kernel", [(name, None) for name in MOE_VARIANTS] + [("qwen3-moe", "pallas")])
def test_greedy_matches_hf(checkpoints, name, moe_kernel):
    """moe_kernel "pallas": the grouped-matmul kernel (kernels/grouped_matmul_gpu.py; interpret mode on the CPU,
    compiled where the tests run on a GPU, whose default it is)."""
    hf, cfg, weights = checkpoints[name]
    with Engine.from_weights(cfg, weights, None, **ENGINE, moe_kernel=moe_kernel) as engine:
        outs = _run(engine)
        assert engine.get_server_info()["moe_kernel"] == (moe_kernel or default_kernel(jax.default_backend()))
    if moe_kernel == "pallas":  # the kernel, not the ragged_dot fallback for block sizes that do not divide
        layers = weights.layers
        assert _pallas_fits(np.zeros((16, cfg.hidden_size), np.float32), layers.we_gate[0], layers.we_down[0])
    assert outs[1]["meta_info"]["cached_tokens"] >= 32  # the second round's first prompt hit the cache
    for prompt, out in zip([LONG] + ROUND2, outs):
        assert out["output_ids"] == _hf_greedy(hf, prompt)


def _specs(engine):
    layers = engine.runner.weights.layers
    return layers.we_gate.sharding.spec, layers.we_down.sharding.spec


@pytest.fixture(scope="module")
def one_device(checkpoints):
    _, cfg, weights = checkpoints["qwen3-moe"]
    with Engine.from_weights(cfg, weights, None, **ENGINE) as one:
        return _run(one)


@pytest.mark.parametrize("tp_size,ep_size", [(2, 1), (2, 2), (4, 4)])
def test_expert_parallel_matches_one_device(checkpoints, one_device, tp_size, ep_size):
    _, cfg, weights = checkpoints["qwen3-moe"]
    want = one_device
    with Engine.from_weights(cfg, weights, None, **ENGINE, tp_size=tp_size, ep_size=ep_size) as engine:
        got = _run(engine)
        gate, down = _specs(engine)
        per_device = tp.addressable_bytes(engine.runner.weights.layers.we_gate)
    P = jax.sharding.PartitionSpec
    if ep_size > 1:  # whole experts: the expert axis split
        assert gate == P(None, "tensor", None, None) and down == P(None, "tensor", None, None)
    else:  # every expert's columns split
        assert gate == P(None, None, None, "tensor") and down == P(None, None, "tensor", None)
    assert len(per_device) == tp_size and len(set(per_device.values())) == 1
    assert sum(per_device.values()) == np.asarray(weights.layers.we_gate).nbytes
    for a, b in zip(want, got):
        assert a["output_ids"] == b["output_ids"]
        np.testing.assert_allclose(
            [lp for lp, _, _ in b["meta_info"]["output_token_logprobs"]],
            [lp for lp, _, _ in a["meta_info"]["output_token_logprobs"]],
            atol=1e-4,
        )


@pytest.mark.parametrize("weight_dtype", ["auto", "bfloat16"])
def test_expert_tokens_reach_server_info_and_metrics(checkpoints, weight_dtype):
    """bfloat16: the native CPU step (engine/plan.py) counts each layer's routing too."""
    _, cfg, weights = checkpoints["olmoe-moe"]
    prompt = list(range(100, 113))
    with Engine.from_weights(cfg, weights, None, **ENGINE, weight_dtype=weight_dtype) as engine:
        engine.generate(input_ids=[prompt], sampling_params=GREEDY)
        info = engine.get_server_info()
    counts = np.asarray(info["expert_tokens"])
    assert counts.shape == (cfg.num_layers, cfg.num_experts)
    # every computed token (the prompt, then the outputs but the last) picks k experts in every layer; padding none
    np.testing.assert_array_equal(counts.sum(axis=1), cfg.num_experts_per_tok * (len(prompt) + NEW - 1))
    text = Metrics().render(info)
    total = sum(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("sgjax:moe_expert_tokens_total{")
    )
    assert total == counts.sum()
    assert 'sgjax:moe_layer_imbalance{layer="0"}' in text


def test_ep_size_errors_name_the_setting(checkpoints):
    _, cfg, weights = checkpoints["mixtral-moe"]
    with pytest.raises(ValueError, match="ep_size=2 must be 1 or tp_size=4"):
        Engine.from_weights(cfg, weights, None, **ENGINE, tp_size=4, ep_size=2)
    with pytest.raises(ValueError, match="ep_size=2 needs a mixture-of-experts"):
        tp.check_model(cfg.replace(num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0), 2, 2)
    with pytest.raises(ValueError, match="must divide the model's 4 experts"):
        tp.check_model(cfg, 8, 8)


def test_served_with_ep_size_to_the_openai_client(tmp_path):
    """`sgjax serve --tp-size 2 --ep-size 2 --load-format dummy` on a Qwen3-MoE config with SmolLM2's tokenizer (a
    child process with 4 CPU host devices): the official client's completion equals the one-device engine's greedy
    text, and /metrics counts the routed tokens."""
    import httpx
    import openai

    from sgjax.model.config import ModelConfig
    from sgjax.model.families import hf_config_dict
    from sgjax.model.paths import default_model_path
    from sgjax.model.tokenizer import load_tokenizer, save_hf_dir
    from tests.server.conftest import serving

    cfg = ModelConfig(
        "qwen3_moe",
        49152,
        64,
        128,
        2,
        4,
        2,
        16,
        qk_norm=True,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        tie_word_embeddings=True,
    )
    tok = load_tokenizer(default_model_path())
    save_hf_dir(tok, str(tmp_path), {**hf_config_dict(cfg), "eos_token_id": list(tok.eos_token_ids)})
    prompt, new = "The capital of France is", 6
    with Engine(str(tmp_path), load_format="dummy", **ENGINE) as engine:
        want = engine.generate(prompt, {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True})["text"]
    flags = [
        "--model-path",
        str(tmp_path),
        "--load-format",
        "dummy",
        "--tp-size",
        "2",
        "--ep-size",
        "2",
        "--enable-metrics",
        *(x for k, v in ENGINE.items() for x in ("--" + k.replace("_", "-"), str(v))),
    ]
    srv = serving(*flags, env={"JAX_NUM_CPU_DEVICES": "4"})
    server = next(srv)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        got = client.completions.create(
            model="default", prompt=prompt, max_tokens=new, temperature=0, extra_body={"ignore_eos": True}
        )
        assert got.choices[0].text == want
        metrics = httpx.get(server.url + "/metrics").text
        routed = sum(
            float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith("sgjax:moe_expert_tokens_total{")
        )
        assert routed > 0 and routed % (cfg.num_layers * cfg.num_experts_per_tok) == 0
    finally:
        next(srv, None)
