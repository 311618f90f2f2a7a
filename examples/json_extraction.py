"""JSON extraction with a JSON schema: the engine's FSM constrains the output, so every answer parses, and the
compressed FSM writes the schema's fixed text (keys, quotes) by jump-forward instead of token by token. Bounds
(maxLength, maximum) keep a small model from writing digits forever.

    .venv/bin/python examples/json_extraction.py
"""

import argparse
import json

import sgjax as sgl

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "maxLength": 20},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 100},
    },
    "required": ["city", "country", "population_millions"],
}
PASSAGES = [
    "Paris is the capital and largest city of France, with about 2.1 million residents in the city proper.",
    "Tokyo, the capital of Japan, is home to roughly 14 million people.",
    "Nairobi is the capital of Kenya; about 4.4 million people live there.",
]


@sgl.function
def extract(s, passage):
    s += sgl.user("Extract the city, its country and its population in millions (rounded) as JSON.\n\n" + passage)
    s += sgl.assistant(sgl.gen("json", json_schema=SCHEMA))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None, help="GGUF file or HF directory (default: bundled SmolLM2)")
    args = parser.parse_args()
    with sgl.Runtime(args.model_path, max_total_tokens=8192) as runtime:
        states = extract.run_batch([{"passage": p} for p in PASSAGES], backend=runtime, temperature=0)
        for passage, state in zip(PASSAGES, states):
            print(f"{passage}\n  -> {json.loads(state['json'])}")
        info = runtime.get_server_info()
        print(f"\n{info['jump_forward_tokens']} tokens written by jump-forward")


if __name__ == "__main__":
    main()
