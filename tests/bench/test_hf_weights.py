"""The HF baseline over sgjax's own weights (GPU runs give HF the dummy Llama-3-8B): the conversion is exact."""

import os
import sys

import numpy as np
import pytest
import torch

from sgjax.model.loader import load_hf_dir
from sgjax.model.weights import from_hf_state_dict, to_hf_state_dict
from tests.model.hf_tiny import hf_logits, write_tiny

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "bench"))
from hf_backend import hf_model_from_weights  # noqa: E402


# every family's own HF class: its names, fused projections (Phi-3) and norm offsets (Gemma) in both directions
@pytest.mark.parametrize(
    "variant", ["llama-gqa4", "qwen2-bias", "qwen3-qk-norm", "gemma3-local-global", "gemma2-softcap", "phi3-fused"]
)
def test_hf_model_from_weights_is_the_original_model(variant, tmp_path):
    original = write_tiny(variant, str(tmp_path))
    cfg, weights = load_hf_dir(str(tmp_path))
    state = to_hf_state_dict(cfg, weights)
    again = from_hf_state_dict(cfg, state.__getitem__, set(state))
    for leaf_a, leaf_b in zip(*(jax_leaves(w) for w in (weights, again))):
        np.testing.assert_array_equal(leaf_a, leaf_b)
    rebuilt = hf_model_from_weights(cfg, weights, "cpu", torch.float32)
    rebuilt.config._attn_implementation = "eager"  # as the original: the attention that applies Gemma 2's soft cap
    ids = [3, 17, 250, 9, 9, 41, 128]
    np.testing.assert_allclose(hf_logits(rebuilt, ids), hf_logits(original, ids), rtol=0, atol=1e-5)


def jax_leaves(w):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(w)]
