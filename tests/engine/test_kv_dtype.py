"""--kv-cache-dtype (engine/loading.default_kv_dtype, model/config.kv_dtype): a bf16 pool under a float32 model, what
auto picks where, what is refused by name, and an engine on a bf16 pool against one on a float32 pool (the CPU kernel
writes and reads it: kernels/cpu_attention.cc; tests/kernels cover its rounding)."""

import jax.numpy as jnp
import pytest

from sgjax.engine import loading
from sgjax.engine.args import ServerArgs
from tests.engine.conftest import tiny_engine

GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def test_auto_and_the_values_checked(monkeypatch):
    resolve = loading.default_kv_dtype
    # SGJAX_AUTO_BF16=0 (tests/conftest): auto is the model's dtype
    assert resolve(ServerArgs(), "float32", "bfloat16", "cpu", "cpu") == "float32"
    assert resolve(ServerArgs(), "bfloat16", "bfloat16", "pallas", "gpu") == "bfloat16"
    monkeypatch.setenv(loading.AUTO_BF16_ENV, "1")
    # auto takes bf16 where auto bf16 matrices do (a float32 model on one CPU with bf16 dots), and only for weights
    # that are not float32 and an attention backend that reads such a pool
    for has, weights, attention, platform, args, expected in [
            (True, "bfloat16", "cpu", "cpu", ServerArgs(), "bfloat16"),
            (True, "int4", "cpu", "cpu", ServerArgs(), "bfloat16"),
            (True, "float32", "cpu", "cpu", ServerArgs(), "float32"),
            (False, "bfloat16", "cpu", "cpu", ServerArgs(), "float32"),
            (True, "bfloat16", "pallas", "cpu", ServerArgs(), "float32"),
            (True, "bfloat16", "ref", "cpu", ServerArgs(), "float32"),  # XLA's scatter would convert the pool
            (True, "bfloat16", "cpu", "gpu", ServerArgs(), "float32"),
            (True, "bfloat16", "cpu", "cpu", ServerArgs(tp_size=2), "float32"),
            (True, "bfloat16", "cpu", "cpu", ServerArgs(kv_cache_dtype="float32"), "float32")]:
        monkeypatch.setattr(loading, "cpu_has_bf16_dots", lambda has=has: has)
        assert resolve(args, "float32", weights, attention, platform) == expected, (has, weights, attention, args)
    # asked for: a bf16 pool under float32 where the backend reads one; the rest refused by name
    assert resolve(ServerArgs(kv_cache_dtype="bfloat16"), "float32", "float32", "ref", "cpu") == "bfloat16"
    with pytest.raises(ValueError, match="kv_cache_dtype 'bfloat16' under a float32 model needs"):
        resolve(ServerArgs(kv_cache_dtype="bfloat16"), "float32", "float32", "pallas", "gpu")
    with pytest.raises(ValueError, match="kv_cache_dtype 'float32': a float32 KV cache for a bfloat16 model"):
        resolve(ServerArgs(kv_cache_dtype="float32"), "bfloat16", "bfloat16", "pallas", "gpu")
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8_e5m2': an fp8 KV cache is not supported"):
        resolve(ServerArgs(kv_cache_dtype="fp8_e5m2"), "float32", "float32", "cpu", "cpu")
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        resolve(ServerArgs(kv_cache_dtype="int8"), "float32", "float32", "cpu", "cpu")


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
        (la, ta, _), (lb, tb, _) = a["meta_info"]["output_token_logprobs"][0], b["meta_info"]["output_token_logprobs"][0]
        assert ta == tb and abs(la - lb) < 0.05
        assert sum(x == y for x, y in zip(a["output_ids"], b["output_ids"])) >= 4
