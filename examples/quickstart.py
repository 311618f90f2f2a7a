"""Greedy generation on the default model (SmolLM2-135M-Instruct), printing text and tokens/s.

    make run            # set-up + this script
    .venv/bin/python examples/quickstart.py --model-path /path/to/model.gguf --max-new-tokens 64
"""

import argparse
import os
import time

os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".jax_cache"))

import jax  # noqa: E402

jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

from sgjax.model.generate import GreedyGenerator  # noqa: E402
from sgjax.model.loader import load_model  # noqa: E402
from sgjax.model.tokenizer import load_tokenizer  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give three tips for staying healthy.",
    "Explain what a radix tree is in one sentence.",
]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None, help="GGUF file or HF directory (default: bundled SmolLM2)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()

    t0 = time.perf_counter()
    cfg, weights = load_model(args.model_path, dtype=args.dtype)
    tok = load_tokenizer(args.model_path)
    print(f"loaded {cfg.architecture} ({cfg.num_params() / 1e6:.0f}M params, {cfg.dtype}) "
          f"in {time.perf_counter() - t0:.1f}s on {jax.devices()[0].platform}")

    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    ids = [tok.encode(p) for p in prompts]
    gen = GreedyGenerator(cfg, weights, page_size=16, max_context=512, max_batch=len(ids))
    gen.generate(ids, args.max_new_tokens, stop_ids=tok.eos_token_ids)  # compile every bucket it meets; time the rerun
    result = gen.generate(ids, args.max_new_tokens, stop_ids=tok.eos_token_ids)

    for q, out in zip(QUESTIONS, result.output_ids):
        print(f"\n### {q}\n{tok.decode(out).strip()}")
    new_tokens = sum(len(o) for o in result.output_ids)
    total = result.prefill_seconds + result.decode_seconds
    print(f"\n{len(ids)} prompts, {sum(map(len, ids))} prompt tokens, {new_tokens} new tokens in {total:.2f}s: "
          f"{new_tokens / total:.1f} tokens/s overall, "
          f"{len(ids) * result.decode_steps / max(result.decode_seconds, 1e-9):.1f} tokens/s in decode "
          f"(batch {len(ids)}), prefill {result.prefill_seconds * 1000:.0f} ms")


if __name__ == "__main__":
    main()
