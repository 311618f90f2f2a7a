"""Multi-turn chat with the model's own chat template: each turn's request extends the conversation so far, which
the radix cache already holds (the paper's multi-turn sharing pattern). Prints the dialogue, the cached tokens of
each turn and the messages in OpenAI format.

    .venv/bin/python examples/multi_turn_chat.py
"""

import argparse

import sgjax as sgl

TURNS = ["What is the capital of France?", "What is a famous tower there?", "How tall is it, roughly?"]


@sgl.function
def chat(s, turns):
    s += sgl.system("You are a helpful assistant. Answer in one short sentence.")
    for i, question in enumerate(turns):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen(f"answer_{i}", max_tokens=32))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None, help="GGUF file or HF directory (default: bundled SmolLM2)")
    args = parser.parse_args()
    with sgl.Runtime(args.model_path, max_total_tokens=8192) as runtime:
        state = chat.run(TURNS, backend=runtime, temperature=0)
        for i, question in enumerate(TURNS):
            meta = state.get_meta_info(f"answer_{i}")
            print(
                f"user: {question}\nassistant: {state[f'answer_{i}'].strip()}\n"
                f"  (turn {i + 1}: {meta['cached_tokens']} of {meta['prompt_tokens']} prompt tokens cached)"
            )
        print("\nmessages:", state.messages())


if __name__ == "__main__":
    main()
