"""Tree of thought: fork a few plans for a question, fork a few answers under each plan, let the model check each
answer with `select`, and keep the first one it accepts. Sibling branches share their whole history, which the
frontend hint sends once before the branches start (the paper's tree-of-thought sharing pattern). Prints the tree
and the cache hit rate.

    .venv/bin/python examples/tree_of_thought.py
"""

import argparse

import sgjax as sgl


@sgl.function
def tree_of_thought(s, question, width=2):
    s += sgl.system("You solve problems. Be brief.")
    s += sgl.user(question + " First give a plan in one sentence.")
    plans = s.fork(width)
    plans += sgl.assistant(sgl.gen("plan", max_tokens=32))
    answers = []
    for plan in plans:
        tries = plan.fork(width)
        tries += sgl.user("Now give the answer in one sentence.") + sgl.assistant(sgl.gen("answer", max_tokens=32))
        tries += sgl.user("Is this answer correct?") + sgl.assistant(sgl.select("ok", choices=["yes", "no"]))
        answers += [(plan, t) for t in tries]
    best = next((a for _, a in answers if a["ok"] == "yes"), answers[0][1])
    s += sgl.user("What is the best answer?") + sgl.assistant(best["answer"])
    return answers


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None, help="GGUF file or HF directory (default: bundled SmolLM2)")
    parser.add_argument("--question", default="How can I keep my plants alive while I am on holiday for two weeks?")
    args = parser.parse_args()
    with sgl.Runtime(args.model_path, max_total_tokens=8192) as runtime:
        state = tree_of_thought.run(args.question, backend=runtime, temperature=0.7)
        for plan, answer in state.ret_value:
            print(f"plan: {plan['plan'].strip()}\n  answer: {answer['answer'].strip()}  (correct? {answer['ok']})")
        print("\nbest answer: " + state.messages()[-1]["content"].strip())
        print(f"cache hit rate {runtime.get_server_info()['cache_hit_rate']:.2f}")


if __name__ == "__main__":
    main()
