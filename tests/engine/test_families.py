"""Each model family through the Engine: greedy outputs equal HF transformers' on a tiny random checkpoint, with the
radix cache reusing a prefix longer than the sliding window, and chunked prefill crossing the window's edge."""

import numpy as np
import pytest
import torch

from sgjax.engine.engine import Engine
from tests.model.hf_tiny import write_tiny

NEW = 32


def hf_greedy(model, ids, n):
    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


# Qwen3's one change (q/k norms) is in the forward alone: test_parity covers it; these four touch the cache too
@pytest.mark.parametrize("variant", ["mistral-window", "gemma3-local-global", "gemma2-softcap", "phi3-fused"])
def test_greedy_equals_hf_with_prefix_hits_across_the_window(variant, tmp_path):
    hf = write_tiny(variant, str(tmp_path))
    rng = np.random.default_rng(0)
    first = [int(t) for t in rng.integers(3, 300, size=13)]
    second = first[:10] + [int(t) for t in rng.integers(3, 300, size=4)]  # a 10-token prefix: past every window
    params = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
    with Engine(
        str(tmp_path),
        dtype="float32",
        skip_tokenizer_init=True,
        page_size=4,
        max_total_tokens=512,
        chunked_prefill_size=8,
        max_running_requests=4,
    ) as eng:
        cfg = eng.model_config
        assert cfg.architecture == variant.split("-")[0]
        assert cfg.sliding_window is None or cfg.sliding_window < 8  # inside one chunk and the cached prefix
        a = eng.generate(input_ids=first, sampling_params=params)
        b = eng.generate(input_ids=second, sampling_params=params)
    assert b["meta_info"]["cached_tokens"] >= 8  # two pages of the shared prefix came from the radix cache
    assert a["output_ids"] == hf_greedy(hf, first, NEW)
    assert b["output_ids"] == hf_greedy(hf, second, NEW)
