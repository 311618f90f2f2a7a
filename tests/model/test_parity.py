"""Parity with HF transformers on tiny random Llama and Qwen2 checkpoints (fp32 logits within 1e-4)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgjax.kernels import allocate_pool, ref_attention
from sgjax.model.batch import build_batch
from sgjax.model.loader import load_hf_dir
from sgjax.model.weights import unstack_layers
from tests.model.hf_tiny import VARIANTS, hf_logits, write_tiny
from tests.model.steps import make_step

PAGE = 4
PAGES_PER_REQ = 8
NUM_PAGES = 40


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tiny(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    hf = write_tiny(request.param, path)
    cfg, weights = load_hf_dir(path)
    return hf, cfg, weights


class Runner:
    """Drives the jitted step with shuffled (non-contiguous) page tables, as the cache will."""

    def __init__(self, cfg, weights, seed=0):
        self.cfg, self.weights = cfg, weights
        self.step = make_step(cfg, ref_attention)
        self.pool = allocate_pool(
            cfg.num_layers, NUM_PAGES, PAGE, cfg.num_kv_heads, cfg.head_dim, dtype=jnp.dtype(cfg.dtype)
        )
        pages = np.random.default_rng(seed).permutation(np.arange(1, NUM_PAGES))
        self.tables = [list(pages[i * PAGES_PER_REQ : (i + 1) * PAGES_PER_REQ]) for i in range(4)]

    def run(self, chunks, kv_lens, all_rows=False, num_tokens=32):
        rows = None
        if all_rows:
            rows, t = [], 0
            for c in chunks:
                rows += list(range(t, t + len(c)))
                t += len(c)
        batch = build_batch(
            chunks,
            kv_lens,
            self.tables[: len(chunks)],
            PAGE,
            num_tokens,
            4,
            PAGES_PER_REQ,
            logits_rows=rows,
            num_logits=num_tokens if all_rows else None,
        )
        logits, self.pool = self.step(self.weights, self.pool, jax.tree.map(jnp.asarray, batch))
        return np.asarray(logits)


def _seqs(cfg, lengths, seed=1):
    rng = np.random.default_rng(seed)
    return [list(rng.integers(0, cfg.vocab_size, size=n)) for n in lengths]


def test_ragged_prefill(tiny):
    hf, cfg, weights = tiny
    seqs = _seqs(cfg, (7, 13, 1))  # crosses page boundaries; 4th request slot and 11 rows are padding
    out = Runner(cfg, weights).run(seqs, [len(s) for s in seqs], all_rows=True)
    t = 0
    for s in seqs:
        np.testing.assert_allclose(out[t : t + len(s)], hf_logits(hf, s), atol=1e-4, rtol=0)
        t += len(s)


def test_extend_after_cached_prefix(tiny):
    hf, cfg, weights = tiny
    seqs = _seqs(cfg, (11, 9, 17), seed=2)
    split = (5, 8, 12)  # prefix lengths: on and off page boundaries
    runner = Runner(cfg, weights)
    runner.run([s[:p] for s, p in zip(seqs, split)], list(split))
    out = runner.run([s[p:] for s, p in zip(seqs, split)], [len(s) for s in seqs], all_rows=True)
    t = 0
    for s, p in zip(seqs, split):
        n = len(s) - p
        np.testing.assert_allclose(out[t : t + n], hf_logits(hf, s)[p:], atol=1e-4, rtol=0)
        t += n


def test_decode_steps(tiny):
    hf, cfg, weights = tiny
    seqs = _seqs(cfg, (6, 10, 3), seed=3)
    prompt = (3, 6, 1)
    runner = Runner(cfg, weights)
    first = runner.run([s[:p] for s, p in zip(seqs, prompt)], list(prompt))
    refs = [hf_logits(hf, s) for s in seqs]
    for r, p in enumerate(prompt):
        np.testing.assert_allclose(first[r], refs[r][p - 1], atol=1e-4, rtol=0)
    for k in range(2):  # two decode steps, one token per request, fed from the reference sequence
        out = runner.run([[s[p + k]] for s, p in zip(seqs, prompt)], [p + k + 1 for p in prompt])
        for r, p in enumerate(prompt):
            np.testing.assert_allclose(out[r], refs[r][p + k], atol=1e-4, rtol=0)


def test_bfloat16_close_to_fp32_reference(tiny):
    hf, cfg, weights = tiny
    cfg16 = cfg.replace(dtype="bfloat16")
    weights16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), weights)
    seqs = _seqs(cfg, (9, 4), seed=4)
    out = Runner(cfg16, weights16).run(seqs, [len(s) for s in seqs])
    for r, s in enumerate(seqs):
        ref = hf_logits(hf, s)[-1]
        assert np.isfinite(out[r]).all()
        assert np.abs(out[r] - ref).max() / np.abs(ref).max() < 0.05


# The families whose layer loop differs (windows per layer, two RoPE sets, expert counts stacked); the blocks
# themselves are the scanned loop's, which every family runs above.
UNROLLED = ["llama-gqa4", "mistral-window", "gemma2-softcap", "gemma3-local-global", "qwen3-moe"]


@pytest.mark.parametrize("tiny", UNROLLED, indirect=True)
def test_unrolled_layers_match_hf(tiny):
    """The accelerator layout (a tuple of per-layer weights, unrolled) computes the same logits."""
    hf, cfg, weights = tiny
    unrolled = unstack_layers(weights)
    assert isinstance(unrolled.layers, tuple) and len(unrolled.layers) == cfg.num_layers
    seqs = _seqs(cfg, (6, 11), seed=5)
    runner = Runner(cfg, unrolled)
    runner.run([s[:4] for s in seqs], [4, 4])
    out = runner.run([s[4:] for s in seqs], [len(s) for s in seqs], all_rows=True)
    t = 0
    for s in seqs:
        np.testing.assert_allclose(out[t : t + len(s) - 4], hf_logits(hf, s)[4:], atol=1e-4, rtol=0)
        t += len(s) - 4
