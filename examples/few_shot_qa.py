"""Few-shot question answering: every program starts with the same examples, so the radix cache computes them
once for the whole batch (the sharing pattern of the paper's MMLU and HellaSwag workloads). Prints the answers,
the cached tokens of each program and the cache hit rate.

    .venv/bin/python examples/few_shot_qa.py
"""

import argparse
import time

import sgjax as sgl

EXAMPLES = (
    "Answer each question with one word.\n"
    "Q: What color is the sky on a clear day?\nA: Blue\n"
    "Q: What animal says moo?\nA: Cow\n"
    "Q: What is frozen water called?\nA: Ice\n"
    "Q: Which star gives the Earth its daylight?\nA: Sun\n"
    "Q: What do you call a baby dog?\nA: Puppy\n"
)
QUESTIONS = [
    "What do bees make?",
    "What is the opposite of hot?",
    "Which planet do we live on?",
    "What do cows drink?",
    "What falls from clouds when it rains?",
    "What do you call a baby cat?",
    "Which season comes after winter?",
    "What color is grass?",
]


@sgl.function
def few_shot_qa(s, question):
    s += EXAMPLES + "Q: " + question + "\nA:"
    s += sgl.gen("answer", max_tokens=6, stop="\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None, help="GGUF file or HF directory (default: bundled SmolLM2)")
    args = parser.parse_args()
    with sgl.Runtime(args.model_path, max_total_tokens=8192) as runtime:
        t0 = time.perf_counter()
        states = few_shot_qa.run_batch([{"question": q} for q in QUESTIONS], backend=runtime, temperature=0)
        seconds = time.perf_counter() - t0
        for q, state in zip(QUESTIONS, states):
            meta = state.get_meta_info("answer")
            print(
                f"{q:45s} -> {state['answer'].strip():10s} (cached {meta['cached_tokens']} of "
                f"{meta['prompt_tokens']} prompt tokens)"
            )
        info = runtime.get_server_info()
        print(f"\n{len(states)} programs in {seconds:.1f}s; cache hit rate {info['cache_hit_rate']:.2f}")


if __name__ == "__main__":
    main()
