"""--kv-cache-dtype bfloat16 under a float32 model: an engine on a bf16 pool against one on a float32 pool (the CPU
kernel writes and reads it: kernels/cpu_attention.cc; tests/kernels cover its rounding). What auto picks where, and
what is refused by name: tests/engine/test_plan.py."""

import jax.numpy as jnp

from tests.engine.conftest import tiny_engine

GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def test_engine_on_a_bf16_pool_matches_float32(tiny):
    prompts = [[5, 9, 27, 101, 3], list(range(200, 231))]
    runs = {}
    for kv in ("float32", "bfloat16"):
        with tiny_engine(tiny, kv_cache_dtype=kv) as eng:
            outs = eng.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
            again = eng.generate(input_ids=prompts, sampling_params=GREEDY)  # from the radix cache's pages
            info = eng.get_server_info()
            assert eng.runner.state.pool.dtype == jnp.dtype(kv)
        assert info["kv_cache_dtype"] == kv and info["dtype"] == "float32"
        assert [o["output_ids"] for o in again] == [o["output_ids"] for o in outs]
        assert again[1]["meta_info"]["cached_tokens"] >= 16  # its first page (the short prompt has none)
        runs[kv] = outs
    for a, b in zip(runs["float32"], runs["bfloat16"]):
        # the first token's logprob differs only by the prompt's keys and values rounded to bf16
        (la, ta, _), (lb, tb, _) = (
            a["meta_info"]["output_token_logprobs"][0],
            b["meta_info"]["output_token_logprobs"][0],
        )
        assert ta == tb and abs(la - lb) < 0.05
        assert sum(x == y for x, y in zip(a["output_ids"], b["output_ids"])) >= 4
