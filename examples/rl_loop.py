"""A policy-gradient loop with sgjax as the sampler: each step samples a batch of answers, scores them with a toy
reward (the share of digits in the text), takes one REINFORCE step in JAX on the same params (a hand-written SGD
update over model/sequence.py's full-sequence logprobs), and syncs the new params into the running engine in
process (Engine.update_weights: no files, no server). Prints the mean reward, the sampled text and the sync time.

    .venv/bin/python examples/rl_loop.py --steps 4          # SmolLM2 in float32 on this machine
    .venv/bin/python examples/rl_loop.py --tiny             # the tiny random model (seconds)
"""

import argparse
import os
import time

os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".jax_cache"))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from sgjax.engine.engine import Engine  # noqa: E402
from sgjax.model.sequence import sequence_logprobs  # noqa: E402

PROMPT = "<|im_start|>user\nWrite a phone number.<|im_end|>\n<|im_start|>assistant\n"


def reward(text: str) -> float:
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def models(tiny: bool):
    """(cfg, trainer params in float32, engine): the trainer and the engine start from the same weights."""
    settings = dict(max_total_tokens=4096, chunked_prefill_size=128, max_running_requests=8)
    if tiny:
        from sgjax.model.presets import TINY_SMOLLM2_VOCAB
        from sgjax.model.tokenizer import load_tokenizer
        from sgjax.model.weights import dummy_weights

        cfg, params = TINY_SMOLLM2_VOCAB, dummy_weights(TINY_SMOLLM2_VOCAB)
        return cfg, params, Engine.from_weights(cfg, params, load_tokenizer(None), **settings)
    from sgjax.model.loader import load_model

    cfg, params = load_model(None, "float32")
    # float32 matrices: the engine serves what the trainer learns, not a 4-bit copy of it
    return cfg, params, Engine(dtype="float32", weight_dtype="float32", **settings)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--tiny", action="store_true", help="the tiny random model with SmolLM2's tokenizer")
    args = ap.parse_args(argv)
    cfg, params, engine = models(args.tiny)
    prompt = engine.tokenizer.encode(PROMPT)
    sampling = {"max_new_tokens": args.new_tokens, "temperature": 1.0, "ignore_eos": True}
    rows = []

    @jax.jit
    def sgd(params, grads):
        return jax.tree.map(lambda p, g: p - args.lr * g, params, grads)

    with engine:
        for step in range(args.steps):
            outs = engine.generate(input_ids=[prompt] * args.batch, sampling_params={**sampling, "seed": step})
            rewards = np.array([reward(o["text"]) for o in outs])
            advantage = rewards - rewards.mean()
            seqs = np.array([prompt + o["output_ids"] for o in outs])

            def loss(p):
                answer = sequence_logprobs(p, cfg, seqs)[:, len(prompt) - 1 :]
                return -(advantage[:, None] * answer).sum(axis=1).mean()

            t0 = time.perf_counter()
            params = sgd(params, jax.grad(loss)(params))
            jax.block_until_ready(params)
            t1 = time.perf_counter()
            version = engine.update_weights(params, version=f"step-{step + 1}")
            t2 = time.perf_counter()
            rows.append(
                {
                    "step": step,
                    "reward": float(rewards.mean()),
                    "train_s": t1 - t0,
                    "sync_s": t2 - t1,
                    "version": version,
                }
            )
            print(
                f"step {step}: reward {rewards.mean():.3f}  train {t1 - t0:.2f} s  sync {1000 * (t2 - t1):.0f} ms  "
                f"-> {version}  e.g. {outs[0]['text'][:40]!r}",
                flush=True,
            )
    return rows


if __name__ == "__main__":
    main()
