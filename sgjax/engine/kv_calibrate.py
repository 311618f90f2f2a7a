"""`sgjax kv-scales`: an fp8 KV cache's scales measured on the model's own keys and values.

An engine with a wide pool (the model's dtype) prefills representative prompts (ShareGPT's first human turns in
the chat template, or a file of one prompt per line) a few at a time, reading each layer's largest key or value
magnitude over the pool after each (model/kv_scales.calibrate), and writes SGLang's and vLLM's
--quantization-param-path JSON. Serve with `--kv-cache-dtype fp8_e4m3 --quantization-param-path FILE`.
"""

from __future__ import annotations

import argparse
import json

from sgjax.engine.args import ENGINE_FLAGS, ServerArgs

FOR_DTYPES = ("fp8_e4m3", "fp8_e5m2")  # engine/plan.FP8_KV_DTYPES' names (imported with jax, not for --help)


def add_command(commands) -> None:
    p = commands.add_parser(
        "kv-scales",
        help="measure an fp8 KV cache's scales per layer (--quantization-param-path's JSON)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.add_argument("--for-dtype", default="fp8_e4m3", choices=FOR_DTYPES, help="the cache they are for")
    p.add_argument("--num-prompts", type=int, default=64, help="ShareGPT prompts to measure (default: 64)")
    p.add_argument("--prompts-file", default=None, help="measure these prompts instead (one a line)")
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument(
        "--headroom", type=float, default=1.0, help="scale = headroom x the largest magnitude / the format's largest"
    )
    for name, options in ENGINE_FLAGS:
        if name in ("model_path", "tokenizer_path", "dtype", "tp_size", "load_format", "trust_remote_code"):
            p.add_argument("--" + name.replace("_", "-"), dest=name, default=getattr(ServerArgs(), name), **options)


def prompts(engine, ns) -> list[list[int]]:
    tok = engine.tokenizer
    if ns.prompts_file:
        with open(ns.prompts_file, encoding="utf-8") as f:
            texts = [line.rstrip("\n") for line in f if line.strip()]
        return [tok.encode(t)[: ns.max_prompt_tokens] for t in texts]
    from sgjax.data import sharegpt

    out = []
    for conv in sharegpt(4 * ns.num_prompts):
        turns = conv.get("conversations", [])
        if turns and turns[0].get("from") == "human" and turns[0].get("value"):
            msgs = [{"role": "user", "content": turns[0]["value"]}]
            text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            out.append(tok.encode(text)[: ns.max_prompt_tokens])
        if len(out) == ns.num_prompts:
            break
    return out


def measure(engine, ids: list[list[int]], for_dtype: str, headroom: float = 1.0, chunk: int = 8) -> dict:
    """The --quantization-param-path document for `engine`'s model from prompts `ids`, prefilled `chunk` at a time
    with the pool read after each (a later chunk may take an earlier one's pages): each layer's largest scale."""
    from sgjax.engine.plan import FP8_KV_DTYPES
    from sgjax.model import kv_scales

    if engine.runner.plan.kv_dtype not in ("float32", "bfloat16"):
        raise ValueError("kv-scales: measure over a wide pool (the model's dtype), not " + engine.runner.plan.kv_dtype)
    pool_dtype = FP8_KV_DTYPES[for_dtype]
    doc = None
    for i in range(0, len(ids), chunk):
        engine.generate(input_ids=ids[i : i + chunk], sampling_params={"max_new_tokens": 1, "temperature": 0.0})
        seen = engine._call(lambda: kv_scales.calibrate(engine.runner.state.pool, pool_dtype, headroom))
        if doc is not None:
            was, now = doc["kv_cache"]["scaling_factor"]["0"], seen["kv_cache"]["scaling_factor"]["0"]
            now.update({layer: max(s, was[layer]) for layer, s in now.items()})
        doc = seen
    return doc


def main(ns) -> None:
    from sgjax.engine.engine import Engine

    settings = {name: getattr(ns, name) for name, _ in ENGINE_FLAGS if hasattr(ns, name) and name != "model_path"}
    with Engine(ns.model_path, **settings) as engine:
        doc = measure(engine, prompts(engine, ns), ns.for_dtype, ns.headroom)
    with open(ns.out, "w") as f:
        json.dump(doc, f, indent=1)
    scales = list(doc["kv_cache"]["scaling_factor"]["0"].values())
    print(f"wrote {ns.out}: {len(scales)} layers, scales {min(scales):.4g} to {max(scales):.4g}")
