"""API speculative execution (the SGLang paper, Section 5): extract three fields from Wikipedia passages (SQuAD's)
through an OpenAI-compatible API, with and without `num_api_spec_tokens`, and count the API calls and input tokens
each way. Without speculation every field is a call that sends the whole passage again; with it the first field's
call continues past its stop, and the next fields are read from that text when it follows the program's format.

    .venv/bin/python examples/api_speculative.py                       # starts `sgjax serve` (SmolLM2) itself
    .venv/bin/python examples/api_speculative.py --num-passages 16 --spec-tokens 48
    .venv/bin/python examples/api_speculative.py --base-url http://localhost:30000/v1 --model M   # any OpenAI API

The values are the same both ways under greedy decoding (checked here); the paper reports about 3x fewer input
tokens with GPT-3.5.
"""

import argparse
import time

import sgjax as sgl

FIELDS = ("topic", "place", "year")
INSTRUCTION = "Extract the topic, the place and the year from each Wikipedia passage.\n\n"
EXAMPLES = (
    "Passage: The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It was "
    "designed by the company of Gustave Eiffel and built from 1887 to 1889.\n"
    "Topic: the Eiffel Tower\nPlace: Paris, France\nYear: 1889\n\n"
    "Passage: The Apollo 11 mission landed the first two people on the Moon in July 1969. It was launched from the "
    "Kennedy Space Center in Florida by a Saturn V rocket.\n"
    "Topic: Apollo 11\nPlace: Kennedy Space Center, Florida\nYear: 1969\n\n"
)


def extract_fields(s, passage, max_tokens=16):
    s += INSTRUCTION + EXAMPLES + "Passage: " + passage + "\n"
    s += "Topic:" + sgl.gen("topic", stop="\n", max_tokens=max_tokens)
    s += "\nPlace:" + sgl.gen("place", stop="\n", max_tokens=max_tokens)
    s += "\nYear:" + sgl.gen("year", stop="\n", max_tokens=max_tokens)


def passages(n: int, max_words: int = 80) -> list[str]:
    """The first n distinct SQuAD Wikipedia paragraphs of at most max_words words."""
    from sgjax.data import squad

    out = []
    for row in squad():
        text = row["query"].split("\nBackground: ", 1)[1].split("\nQuestion:", 1)[0]
        if len(text.split()) <= max_words and text not in out:
            out.append(text)
        if len(out) == n:
            break
    return out


def measure(backend, texts: list[str], spec_tokens: int | None, max_tokens: int = 16) -> tuple[list, dict, float]:
    """Run the extraction on every passage (in parallel); the states, the API usage and the seconds it took."""
    program = sgl.function(extract_fields, num_api_spec_tokens=spec_tokens)
    backend.usage.reset()
    start = time.perf_counter()
    states = program.run_batch(
        [{"passage": t, "max_tokens": max_tokens} for t in texts], backend=backend, temperature=0
    )
    for state in states:
        state.sync()  # run_batch returns when every program ran
    return states, backend.usage.snapshot(), time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=None, help="an OpenAI-compatible API (default: start sgjax serve)")
    parser.add_argument("--model", default=None, help="the model name (default: the served model)")
    parser.add_argument(
        "--model-path", default=None, help="without --base-url: the model sgjax serve loads (default: bundled SmolLM2)"
    )
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-passages", type=int, default=8)
    parser.add_argument("--spec-tokens", type=int, default=32, help="num_api_spec_tokens")
    parser.add_argument("--max-tokens", type=int, default=16, help="max_tokens of each field")
    args = parser.parse_args()

    server = None
    base_url, model = args.base_url, args.model
    if base_url is None:
        from sgjax.server.process import ServerProcess

        print("starting sgjax serve (SmolLM2) ...", flush=True)
        model_flags = ["--model-path", args.model_path] if args.model_path else []
        server = ServerProcess("--max-total-tokens", "8192", "--max-running-requests", "8", *model_flags).wait_ready()
        base_url = server.url + "/v1"
    try:
        if model is None:
            import openai

            model = openai.OpenAI(base_url=base_url, api_key=args.api_key or "EMPTY").models.list().data[0].id
        backend = sgl.OpenAI(model, base_url=base_url, api_key=args.api_key, is_chat_model=False)
        texts = passages(args.num_passages)
        plain, plain_usage, plain_s = measure(backend, texts, None, args.max_tokens)
        spec, spec_usage, spec_s = measure(backend, texts, args.spec_tokens, args.max_tokens)
    finally:
        if server is not None:
            server.stop()

    same = 0
    for text, a, b in zip(texts, plain, spec):
        va, vb = [a[f] for f in FIELDS], [b[f] for f in FIELDS]
        same += va == vb
        kinds = [b.get_meta_info(f)["speculative"] for f in FIELDS]
        print(
            f"- {text[:60]}...\n  {dict(zip(FIELDS, (v.strip() for v in vb)))}  speculative: {kinds}"
            + ("" if va == vb else f"  WITHOUT: {va}")
        )
    print(
        f"\n{len(texts)} passages, model {model}, num_api_spec_tokens={args.spec_tokens}, greedy; "
        f"identical values: {same}/{len(texts)}"
    )
    print(f"{'':24}{'API calls':>10}{'input tokens':>14}{'output tokens':>15}{'seconds':>9}")
    for name, u, sec in (("without speculation", plain_usage, plain_s), ("with speculation", spec_usage, spec_s)):
        print(f"{name:24}{u['calls']:>10}{u['prompt_tokens']:>14}{u['completion_tokens']:>15}{sec:>9.1f}")
    print(
        f"{'ratio (without / with)':24}{plain_usage['calls'] / spec_usage['calls']:>10.2f}"
        f"{plain_usage['prompt_tokens'] / spec_usage['prompt_tokens']:>14.2f}"
        f"{plain_usage['completion_tokens'] / spec_usage['completion_tokens']:>15.2f}"
    )


if __name__ == "__main__":
    main()
