"""The real SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to fp32) against HF transformers on the same file."""

import jax.numpy as jnp
import numpy as np
import torch

from sgjax.model.batch import BatchShape, build_batch, pack
from tests.conftest import hf_generate_greedy
from tests.model.steps import GreedyGenerator

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Question: What is 12 + 30?\nAnswer:",
    "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village,",
]


def test_logits_match_hf(smollm2, hf_smollm2):
    cfg, weights, tok = smollm2
    ids = tok.encode(PROMPTS[2])
    gen = GreedyGenerator(cfg, weights, page_size=16, max_context=64, max_batch=4)
    batch = build_batch(
        [ids],
        [len(ids)],
        [list(range(1, 5))],
        16,
        32,
        4,
        gen.pages_per_req,
        logits_rows=list(range(len(ids))),
        num_logits=32,
    )
    logits, gen.pool = gen.step(weights, gen.pool, jnp.asarray(pack(batch)), BatchShape.of(batch))
    with torch.no_grad():
        ref = hf_smollm2(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(np.asarray(logits)[: len(ids)], ref, atol=2e-3, rtol=0)


def test_greedy_32_tokens_identical_to_hf(smollm2, hf_smollm2):
    cfg, weights, tok = smollm2
    ids = [tok.encode(p) for p in PROMPTS]
    ours = GreedyGenerator(cfg, weights, page_size=16, max_context=128, max_batch=8).generate(ids, 32)
    want = hf_generate_greedy(hf_smollm2, ids, 32, eos_token_ids=())  # 32 tokens each, EOS or not
    for out, ref in zip(ours.output_ids, want):
        assert len(ref) == 32 and out == ref, tok.decode(out)
