"""The multi-dimensional essay judge of the SGLang paper (Figure 2), on text (the image comes with the multimodal
work): select whether the essay is on topic, judge it along several dimensions in parallel forks, merge the
judgments, then a summary, a grade and a JSON answer constrained by a regex. Runs a batch of essays on the default
model and prints the outputs, the compiler-mode graph of the program and the cache hit rate.

    make run            # set-up + this script
    .venv/bin/python examples/essay_judge.py --model-path /path/to/model.gguf --max-new-tokens 48
    .venv/bin/python examples/essay_judge.py --no-frontend-hint     # the paper's ablation
"""

import argparse
import json
import time

import sgjax as sgl

DIMENSIONS = ["Clarity", "Originality", "Evidence"]
SCHEMA = r'\{"summary": "[\w\d\s]+\.", "grade": "[ABCD][+-]?"\}'


@sgl.function
def essay_judge(s, topic, essay, dimensions=DIMENSIONS):
    s += sgl.system("You are a strict teacher. Evaluate an essay written about a given topic.")
    s += sgl.user("Topic: " + topic + "\nEssay: " + essay)
    s += sgl.assistant("Sure!")
    # Return directly if it is not related. (The paper asks "Is the essay related?"; SmolLM2-135M answers "no" to
    # nearly every yes/no question, so we ask the question the other way round.)
    s += sgl.user("Is the essay off topic?")
    s += sgl.assistant(sgl.select("off_topic", choices=["yes", "no"]))
    if s["off_topic"] == "yes":
        return
    # Judge multiple dimensions in parallel
    forks = s.fork(len(dimensions))
    for f, dim in zip(forks, dimensions):
        f += sgl.user("Evaluate based on the following dimension: " + dim + ". End your judgment with the word 'END'")
        f += sgl.assistant("Judgment: " + sgl.gen("judgment", stop="END"))
    # Merge the judgments
    judgment = "\n".join(f["judgment"] for f in forks)
    s["judgments"] = [f["judgment"] for f in forks]
    # Generate a summary and a grade. Return in the JSON format.
    s += sgl.user("Provide the judgment, summary, and a letter grade")
    s += sgl.assistant(
        judgment
        + "\nIn summary,"
        + sgl.gen("summary", stop=".")
        + "\nThe grade of it is "
        + sgl.gen("grade", max_tokens=4)
    )
    s += sgl.user("Return in the JSON format.")
    s += sgl.assistant(sgl.gen("output", regex=SCHEMA, max_tokens=64))


ESSAYS = [
    (
        "the sea",
        "The sea covers most of our planet. Its waves shape the coast, its currents carry heat around the "
        "world, and millions of people live from fishing. We must keep it clean.",
    ),
    (
        "the sea",
        "Oceans are home to whales, fish and coral reefs. Sailors have crossed the sea for thousands of "
        "years, and ships still carry most of the goods we buy.",
    ),
    (
        "the sea",
        "My favourite food is pizza. I like cheese, tomatoes and a thin crust, and I eat it every Friday "
        "with my family.",
    ),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None, help="GGUF file or HF directory (default: bundled SmolLM2)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="per gen (the JSON answer gets 64)")
    parser.add_argument("--no-frontend-hint", action="store_true", help="forks do not send the shared prefix first")
    args = parser.parse_args()
    sgl.global_config.enable_frontend_hint = not args.no_frontend_hint

    t0 = time.perf_counter()
    runtime = sgl.Runtime(args.model_path, max_total_tokens=8192)
    sgl.set_default_backend(runtime)
    print(f"loaded the model in {time.perf_counter() - t0:.1f}s\n")
    # Compiler mode: the program's graph (the early return depends on a generated value: fix it to trace).
    print(essay_judge.trace(assume={"off_topic": "no"}), "\n")

    t0 = time.perf_counter()
    states = essay_judge.run_batch(
        [{"topic": t, "essay": e} for t, e in ESSAYS],
        temperature=0,
        max_new_tokens=args.max_new_tokens,
        progress_bar=True,
    )
    seconds = time.perf_counter() - t0
    for (topic, essay), state in zip(ESSAYS, states):
        print(f"\n### {essay[:70]}...\noff topic {topic!r}: {state['off_topic']}")
        if state["off_topic"] == "yes":
            continue
        for dim, judgment in zip(DIMENSIONS, state["judgments"]):
            print(f"  {dim}: {' '.join(judgment.split())}")
        print(f"  summary: {state['summary'].strip()}\n  grade: {state['grade'].strip()}")
        output = state["output"]
        print(f"  output: {output}  (valid JSON: {_is_json(output)})")
    info = sgl.get_server_info()
    print(
        f"\n{len(states)} essays in {seconds:.1f}s; cache hit rate {info['cache_hit_rate']:.2f} "
        f"({info['cached_tokens']} of {info['prompt_tokens']} prompt tokens from the radix cache)"
    )
    runtime.shutdown()


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    main()
