"""Run by tests/server/test_upstream_sglang.py in a child process whose path holds upstream SGLang's own frontend
(the `sglang` wheel, installed --no-deps with what its import needs: Makefile's `upstream` step), never sgjax's:
its programs go to a real `sgjax serve` at argv[1] through upstream's RuntimeEndpoint. Prints one JSON object of what
each program produced, for the test to check."""

import json
import sys

import sglang as sgl

url = sys.argv[1]
backend = sgl.RuntimeEndpoint(url)
sgl.set_default_backend(backend)
out = {"sglang_file": sgl.__file__}


@sgl.function
def plain(s, question):
    s += "Q: " + question + "\nA:"
    s += sgl.gen("answer", max_tokens=8, temperature=0)


@sgl.function
def constrained(s):
    s += "The year is "
    s += sgl.gen("year", regex=r"(19|20)[0-9]{2}", max_tokens=8)
    s += ". A person: "
    s += sgl.gen(
        "person",
        max_tokens=48,
        json_schema=json.dumps(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
                "required": ["name", "age"],
            }
        ),
    )


@sgl.function
def choose(s):
    s += "The sky is usually"
    s += sgl.select("colour", choices=[" blue", " green", " purple"])


@sgl.function
def forked(s):
    s += "Two fruits: "
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"fruit {i}: " + sgl.gen("fruit", max_tokens=4, temperature=0)
    forks.join()


@sgl.function
def roles(s):
    s += sgl.system("You are terse.")
    s += sgl.user("Name a colour.")
    s += sgl.assistant(sgl.gen("reply", max_tokens=6, temperature=0))


@sgl.function
def logprobs(s):
    s += "The capital of France is"
    s += sgl.gen(
        "x", max_tokens=3, temperature=0, return_logprob=True, top_logprobs_num=2, return_text_in_logprobs=True
    )


state = plain.run(question="What is 2 + 2?")
out["gen"] = state["answer"]
state = constrained.run()
out["year"], out["person"] = state["year"], state["person"]
out["select"] = choose.run()["colour"]
state = forked.run()
out["fork"] = state["fruit"]
state = roles.run()
out["roles"] = {"reply": state["reply"], "messages": state.messages()}
state = plain.run(question="Say hello.", stream=True)
out["stream_chunks"] = list(state.text_iter(var_name="answer"))
out["stream_final"] = state["answer"]
states = plain.run_batch([{"question": q} for q in ("1 + 1?", "2 + 3?", "Capital of Italy?")], num_threads=3)
out["batch"] = [st["answer"] for st in states]
state = logprobs.run()
meta = state.get_meta_info("x")
out["logprobs"] = {
    "output": meta["output_token_logprobs"],
    "top": meta["output_top_logprobs"],
    "prompt_tokens": meta["prompt_tokens"],
}
backend.flush_cache()
info = backend.get_server_info()
out["server_info_keys"] = sorted(info)
print("RESULT " + json.dumps(out))
