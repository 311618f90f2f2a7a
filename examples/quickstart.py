"""The engine on the default model (SmolLM2-135M-Instruct): a batch of chat prompts, then a few-shot batch that
reuses its shared prefix through the radix cache; prints the answers, tokens/s and the cache hit rate.

    make run            # set-up + this script
    .venv/bin/python examples/quickstart.py --model-path /path/to/model.gguf --max-new-tokens 64
"""

import argparse
import os
import time

os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".jax_cache"))

import jax  # noqa: E402

jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

import sgjax  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give three tips for staying healthy.",
    "Explain what a radix tree is in one sentence.",
]
FEW_SHOT = (
    "Q: What color is the sky on a clear day?\nA: Blue\nQ: What animal says moo?\nA: Cow\n"
    "Q: What is frozen water called?\nA: Ice\n"
)
SHORT = ["What do bees make?", "What is the opposite of hot?", "Which planet do we live on?", "What do cows drink?"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None, help="GGUF file or HF directory (default: bundled SmolLM2)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    args = parser.parse_args()

    t0 = time.perf_counter()
    engine = sgjax.Engine(args.model_path, dtype=args.dtype, max_total_tokens=8192)
    cfg = engine.model_config
    print(
        f"loaded {cfg.architecture} ({cfg.num_params() / 1e6:.0f}M params, {cfg.dtype}) "
        f"in {time.perf_counter() - t0:.1f}s on {jax.devices()[0].platform}"
    )
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    greedy = {"max_new_tokens": args.max_new_tokens, "temperature": 0}
    engine.generate(prompts, greedy)  # compiles the buckets this batch meets; the rerun below is timed
    engine.flush_cache()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, greedy)
    seconds = time.perf_counter() - t0
    for q, out in zip(QUESTIONS, outs):
        print(f"\n### {q}\n{out['text'].strip()}")
    new_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    print(
        f"\n{len(prompts)} prompts, {sum(o['meta_info']['prompt_tokens'] for o in outs)} prompt tokens, "
        f"{new_tokens} new tokens in {seconds:.2f}s: {new_tokens / seconds:.1f} tokens/s"
    )

    few = [FEW_SHOT + f"Q: {q}\nA:" for q in SHORT]
    outs = engine.generate(few, {"max_new_tokens": 4, "temperature": 0, "stop": ["\n"]})
    print(
        "\nfew-shot: "
        + ", ".join(
            f"{q} -> {o['text'].strip()!r} (cached {o['meta_info']['cached_tokens']} of "
            f"{o['meta_info']['prompt_tokens']})"
            for q, o in zip(SHORT, outs)
        )
    )
    info = engine.get_server_info()
    print(
        f"cache hit rate {info['cache_hit_rate']:.2f}, pool usage {info['pool_usage']:.2%}, "
        f"{info['steps']} steps, RadixAttention bookkeeping {info['tree_seconds'] * 1e3:.1f} ms "
        f"of {info['step_seconds']:.2f} s in steps"
    )
    engine.shutdown()


if __name__ == "__main__":
    main()
