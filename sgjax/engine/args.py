"""`ServerArgs`: every engine setting, with SGLang's names (sgjax.cli gives each one a flag)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

# --dtype's spellings (SGLang's) -> ours; None: the platform's default
DTYPES = {
    "auto": None,
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "half": "float16",
    "float16": "float16",
}


@dataclass(frozen=True)
class ServerArgs:
    """Engine settings, with SGLang's names (the paper's ablations are switches here)."""

    model_path: str | None = None
    # auto: the checkpoint's weights; dummy: random weights of the checkpoint's config (an HF directory's
    # config.json), with its tokenizer: serving benchmarks of large shapes where the weights are not at hand.
    load_format: str = "auto"
    # float32 | bfloat16 (SGLang's spellings: auto, float, ...): the activations, and the matrices and the KV pool
    # unless weight_dtype / kv_cache_dtype say otherwise; None / auto: the platform's default (engine/plan.py).
    dtype: str | None = None
    # The matrices' dtype: auto (engine/plan.py: a GGUF's own int4 / int8 blocks, or bf16, on a CPU with the dot
    # instructions, for a float32 model), float32, bfloat16 (bf16 dots with float32 accumulation under float32
    # activations), int8, int4 or fp8 (e4m3, a scale per output row; the layers' projections only).
    weight_dtype: str = "auto"
    # SGLang's --quantization: fp8 (e4m3 matrices, a scale per output row, quantized at load; bf16 activations:
    # w8a16, faster at decode than our w8a8 on an H100), w8a8_fp8 (activations e4m3 per token too) or int8 /
    # w8a16_int8 (weights only). Other methods are refused by name. --weight-dtype fp8 is fp8 as well.
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # auto (bfloat16 beside narrowed matrices on a CPU), float32, bfloat16, fp8_e4m3/e5m2
    # An fp8 KV pool's scales per layer (SGLang's and vLLM's JSON; model/kv_scales.py): None reads the checkpoint's own
    # k_scale / v_scale tensors where it has them, else 1.0.
    quantization_param_path: str | None = None
    # Refuse to start unless a request's greedy tokens cannot depend on the other requests of its steps (SGLang's
    # flag; the plan says which runs promise it: engine/plan.py, docs/engine.md).
    enable_deterministic_inference: bool = False
    tokenizer_path: str | None = None  # the tokenizer's GGUF file or HF directory, when not the model's
    chat_template: str | None = None  # a jinja file or a built-in name (model/chat_templates.py) for the chat routes
    trust_remote_code: bool = False  # accepted for SGLang's launch lines; sgjax runs no model code from checkpoints
    enable_mixed_chunk: bool = False  # accepted: prefill chunks and decode rows always share a step in sgjax
    page_size: int = 16
    max_total_tokens: int | None = None  # KV pool size; default: mem_fraction_static of free device memory
    mem_fraction_static: float = 0.8
    max_running_requests: int = 64
    chunked_prefill_size: int = 512
    schedule_policy: str = "lpm"
    schedule_conservativeness: float = 1.0  # scales the admission reserve for future tokens; 0: admit greedily
    disable_radix_cache: bool = False
    cache: str = "radix"  # radix | table (the "no tree" ablation) | none
    attention_backend: str | None = None  # ref | cpu | pallas; default by platform (kernels/pallas.default_backend)
    context_length: int | None = None
    max_top_logprobs_num: int = 20
    # Request bounds an operator may move (engine/limits.py holds them all): a grammar's text, images per prompt.
    max_grammar_chars: int = 65536
    max_images_per_request: int = 16
    precompile: bool | None = None  # compile the common step shapes at start; default: on accelerators only
    # Step-shape ladder: fine (R, L, K fitted to each batch: CPU, where compiles are cheap) or coarse (the shape
    # follows the token count: accelerators, where a compile costs seconds); default by platform.
    step_buckets: str | None = None
    random_seed: int = 0
    skip_tokenizer_init: bool = False  # input_ids in, output_ids out, no text (dummy-weight benchmarks)
    disable_jump_forward: bool = False  # decode forced grammar text token by token (same output, more steps)
    grammar_cache_size: int = 128  # compiled grammars kept; 0 rebuilds per request (the paper's ablation)
    grammar_compile_timeout: float | None = 20.0  # seconds one regex / JSON schema may take to compile; then a 400
    grammar_backend: str = "sgjax"  # sgjax (the compressed FSM, fsm/) or none (constrained requests refused)
    # JAX's persistent compilation cache, used when the process has not configured one (JAX_COMPILATION_CACHE_DIR
    # or jax.config): restarts then load the step's executables instead of compiling them again.
    compilation_cache_dir: str | None = "~/.cache/sgjax/jax"
    # The engine's loop is a thread that shares the GIL with the caller's threads (the frontend's programs, the
    # HTTP server). Each step gives the GIL up at every device call and waits up to Python's switch interval (5 ms
    # by default) to get it back from a busy thread, which multiplied a tiny model's step time with a few busy
    # threads (scripts/perf/bench_gil.py, docs/results/bench_gil_cpu.jsonl). Process-wide; None leaves the
    # interpreter's setting alone.
    gil_switch_interval_ms: float | None = 0.5
    # Overlap (SGLang's default too): while step k runs on the device, the host commits step k-1 and its streams,
    # and step k+1 reads k's tokens on the device. Every step kind overlaps, penalised rows included (their window
    # names the token in flight); steps with a grammar row or a retraction, and speculative decoding, run one after
    # the other.
    disable_overlap_schedule: bool = False
    # Speculative decoding (SGLang's flags): NGRAM drafts each decoding row's next tokens from its own prompt and
    # output (engine/ngram.py); the step verifies them in the ragged batch by sampling every drafted row as decoding
    # would (same seed and step), so outputs are unchanged; SELF drafts with the model's own first layers and
    # STANDALONE with a smaller model (engine/drafter.py). EAGLE / EAGLE3 / NEXTN are refused by name.
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int = 4  # tokens verified per row and step: its last token and up to N - 1 drafted
    speculative_num_steps: int | None = None  # a draft model's steps; accepted for launch lines, unused by NGRAM
    # SELF (self-speculation, engine/drafter.py): the target's first N layers draft (default: half of them)
    speculative_draft_layers: int | None = None
    # STANDALONE: a smaller model with the target's vocabulary drafts (SGLang's flag), with a KV pool of its own
    speculative_draft_model_path: str | None = None
    # Speculate only while fewer requests than this run (vLLM's flag): a full batch already keeps the device busy,
    # and verify rows then cost more than they save (docs/engine.md); above it the loop overlaps again. None: always.
    speculative_disable_by_batch_size: int | None = None
    # Multi-LoRA (SGLang's flags, engine/adapters.py): HF PEFT adapters served beside the base model, a request's
    # `lora_path` naming one; up to max_loras_per_batch distinct adapters in a step, of rank at most max_lora_rank
    # (default: the largest of lora_paths', else 16) on lora_target_modules (default: those lora_paths' adapters
    # target, else all seven projections).
    enable_lora: bool = False
    lora_paths: tuple[str, ...] | None = None  # name=path (or a bare path, named after its directory)
    max_loras_per_batch: int = 8
    max_lora_rank: int | None = None
    lora_target_modules: tuple[str, ...] | None = None
    max_loaded_loras: int | None = None  # most adapters loaded at once (None: no limit)
    # Prefill/decode disaggregation (SGLang's flags, engine/disagg.py): null (one engine does both), prefill (runs
    # prompts and hands their KV pages out on the bootstrap port) or decode (takes them before it decodes).
    disaggregation_mode: str = "null"
    disaggregation_bootstrap_port: int = 8998
    # How KV pages move (engine/disagg.py): jax (jax.experimental.transfer, device to device), socket (bytes on the
    # bootstrap connection), auto (jax where it works here, else socket). SGLang's mooncake / nixl are refused by name.
    disaggregation_transfer_backend: str = "auto"
    # Tensor parallelism over the first tp_size local devices (engine/mesh.py): weights and the KV pool split by
    # heads, one jitted step over the mesh; the host side is unchanged.
    tp_size: int = 1
    # Expert parallelism for mixtures of experts (engine/mesh.py sharded_experts): 1 splits every expert's columns
    # over the tp_size devices, tp_size gives each device whole experts (SGLang's --ep-size = --tp-size).
    ep_size: int = 1
    # A mixture of experts' grouped matmuls: xla (jax.lax.ragged_dot) or pallas (kernels/grouped_matmul_gpu, reads
    # only the routed experts); None: pallas on CUDA GPUs, xla elsewhere (model/moe.default_kernel).
    moe_kernel: str | None = None
    # Multi-host (engine/distributed.py): nnodes processes, one per host, each running `sgjax serve` with its
    # node_rank; rank 0 serves HTTP and broadcasts every step, the others follow. dist_init_addr is jax.distributed's
    # coordinator (host:port on rank 0's host); port + 1 carries the followers' liveness connections.
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    # Seconds rank 0 waits for a follower to acknowledge a broadcast step before declaring it lost (a stopped or
    # hung follower keeps its connection open, so only its silence tells); 0: wait for ever. Above a new shape's
    # compile time on a follower, which rank 0's next broadcast waits out too.
    dist_step_timeout: float = 60.0

    @classmethod
    def from_kwargs(cls, model_path, kwargs: dict) -> "ServerArgs":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
        return cls(model_path=model_path, **kwargs)


# (ServerArgs field, argparse options). Every engine setting has a flag (tests/server/test_cli.py checks it).
ENGINE_FLAGS = [
    ("model_path", dict(help="GGUF file or HF model directory (default: the bundled SmolLM2-135M-Instruct)")),
    (
        "load_format",
        dict(
            choices=["auto", "dummy"],
            help="auto: the checkpoint's weights; dummy: random weights of the HF directory's "
            "config.json (serving benchmarks of large shapes)",
        ),
    ),
    (
        "dtype",
        dict(
            choices=list(DTYPES),
            help="activations, weights and KV cache dtype: float32 or bfloat16 "
            "(--weight-dtype / --kv-cache-dtype override the last two; SGLang's spellings: auto is the "
            "platform's default, float32 on CPU and bfloat16 on accelerators, and lets auto narrow the "
            "matrices and the pool; float is float32; half / float16 are refused)",
        ),
    ),
    (
        "weight_dtype",
        dict(
            choices=["auto", "float32", "bfloat16", "int8", "int4", "fp8"],
            help="the weight matrices' dtype: auto (--dtype's when given; else on a CPU, for a float32 "
            "model, a GGUF's Q4_0 / Q4_1 / Q8_0 blocks kept as int4 / int8 where the CPU has int8 "
            "dot instructions, else bfloat16 where it has bf16 ones; else the model's), float32, "
            "bfloat16 (bf16 dots with float32 accumulation under float32 activations), int8 "
            "(a scale per 32 weights of a row, or per row) or int4 (groups of 32 weights along a "
            "row, 4 bits each with a scale and a minimum, as llama.cpp's Q4_1) or fp8 (e4m3 with a scale "
            "per output row, the layers' projections only)",
        ),
    ),
    (
        "quantization",
        dict(
            help="quantization at load (SGLang's flag): fp8 (e4m3 matrices, a scale per output row, bf16 "
            "activations: w8a16), w8a8_fp8 (activations quantized per token to e4m3 too) or int8 / "
            "w8a16_int8 (weights only); others (awq, gptq, "
            "compressed-tensors, ...) are refused by name",
        ),
    ),
    (
        "kv_cache_dtype",
        dict(
            choices=["auto", "float32", "bfloat16", "fp8_e4m3", "fp8_e5m2"],
            help="KV cache dtype: auto (--dtype's when given; bfloat16 for a float32 model on a CPU "
            "where auto narrowed the matrices; else the model's), the model's, or bfloat16 "
            "under a float32 model (cpu and ref attention: keys and values stored rounded, "
            "scores in float32); fp8_e4m3 / fp8_e5m2: keys and values stored in fp8 (divided by a scale per "
            "layer: --quantization-param-path's, the checkpoint's k_scale / v_scale, else 1.0; saturated at the "
            "format's range) and widened as attention reads them (ref and pallas backends)",
        ),
    ),
    (
        "quantization_param_path",
        dict(
            help='an fp8 KV cache\'s scales: SGLang\'s and vLLM\'s JSON ({"kv_cache": {"dtype": ..., '
            '"scaling_factor": {rank: {layer: scale}}}}), e.g. written by `sgjax kv-scales`; needs '
            "--kv-cache-dtype fp8_e4m3 / fp8_e5m2",
        ),
    ),
    (
        "enable_deterministic_inference",
        dict(
            action="store_true",
            help="refuse to start unless every request's greedy tokens are independent "
            "of the other requests sharing its steps (batch invariance: the CPU's "
            "native kernels for dense models give it; /server_info's plan says)",
        ),
    ),
    ("tokenizer_path", dict(help="tokenizer GGUF file or HF directory (default: the model's)")),
    (
        "chat_template",
        dict(
            help="chat template for the chat routes: a jinja file or a built-in name "
            "(chatml, llama-3); default: the tokenizer's"
        ),
    ),
    (
        "trust_remote_code",
        dict(
            action="store_true",
            help="accepted for SGLang's launch lines; has no effect (sgjax builds every model from its own code)",
        ),
    ),
    (
        "enable_mixed_chunk",
        dict(
            action="store_true",
            help="accepted for SGLang's launch lines; sgjax always mixes prefill chunks with decode rows in one step",
        ),
    ),
    ("page_size", dict(type=int, help="tokens per KV page; the radix cache matches whole pages")),
    (
        "max_total_tokens",
        dict(
            type=int,
            help="KV pool size in tokens (default: from --mem-fraction-static; 16384 "
            "on CPU, where memory stats are missing)",
        ),
    ),
    (
        "mem_fraction_static",
        dict(
            type=float,
            help="fraction of device memory for weights and the KV pool, used when --max-total-tokens is not given",
        ),
    ),
    ("max_running_requests", dict(type=int, help="most requests in one running batch")),
    (
        "chunked_prefill_size",
        dict(type=int, help="most prompt tokens prefilled in one step; longer prompts are prefilled in chunks"),
    ),
    (
        "schedule_policy",
        dict(
            choices=["lpm", "dfs-weight", "fcfs", "random"],
            help="order of waiting requests: lpm (longest prefix match first), dfs-weight, fcfs, random",
        ),
    ),
    (
        "schedule_conservativeness",
        dict(type=float, help="scales the pages reserved for future output tokens at admission; 0 admits greedily"),
    ),
    ("disable_radix_cache", dict(action="store_true", help="no prefix reuse (the paper's no-cache ablation)")),
    (
        "cache",
        dict(
            choices=["radix", "table", "none"],
            help="prefix cache: radix tree, flat table (the no-tree ablation) or none",
        ),
    ),
    (
        "attention_backend",
        dict(
            choices=["ref", "cpu", "pallas", "pallas:triton", "pallas:mgpu"],
            help="attention implementation (default: cpu, the native kernel, on CPU where it "
            "builds, else ref; pallas on GPU and TPU)",
        ),
    ),
    (
        "moe_kernel",
        dict(
            choices=["xla", "pallas"],
            help="a mixture of experts' grouped matmuls: xla (ragged_dot) or pallas (the Triton "
            "kernel; default on CUDA GPUs)",
        ),
    ),
    ("context_length", dict(type=int, help="longest prompt plus output (default: the model's)")),
    (
        "speculative_algorithm",
        dict(
            type=str.upper,
            choices=["NGRAM", "SELF", "EAGLE", "EAGLE3", "STANDALONE", "NEXTN"],
            help="speculative decoding, verified in the step with outputs unchanged: NGRAM (prompt lookup over "
            "each request's own tokens), SELF (the model's first --speculative-draft-layers layers draft) or "
            "STANDALONE (--speculative-draft-model-path drafts); EAGLE, EAGLE3 and NEXTN are refused",
        ),
    ),
    (
        "speculative_num_draft_tokens",
        dict(type=int, help="tokens verified per decoding row and step: its last token and up to N - 1 drafted"),
    ),
    ("speculative_num_steps", dict(type=int, help="a draft model's steps per round (accepted; NGRAM ignores it)")),
    (
        "speculative_draft_layers",
        dict(type=int, help="SELF: the first N layers, then the final norm and head, draft (default: half)"),
    ),
    (
        "speculative_draft_model_path",
        dict(help="STANDALONE: the draft model (a GGUF file or HF directory with the target's vocabulary)"),
    ),
    (
        "speculative_disable_by_batch_size",
        dict(type=int, help="speculate only while fewer requests than this run (default: always)"),
    ),
    (
        "max_top_logprobs_num",
        dict(type=int, help="largest top_logprobs_num (logprobs, top_logprobs) a request may ask for"),
    ),
    (
        "max_grammar_chars",
        dict(
            type=int,
            help="longest regex, JSON schema, EBNF grammar or structural tag a request may carry, in characters "
            "(a longer one is a 400)",
        ),
    ),
    ("max_images_per_request", dict(type=int, help="most images in one prompt (more is a 400)")),
    (
        "precompile",
        dict(
            action=argparse.BooleanOptionalAction,
            help="compile the common step shapes at start (default: on accelerators only)",
        ),
    ),
    (
        "step_buckets",
        dict(
            choices=["fine", "coarse"],
            help="step-shape ladder: fine fits requests, logits rows and top-logprobs to each batch "
            "(cheap CPU compiles), coarse derives them from the token count (fewer shapes where "
            "a compile costs seconds); default: fine on CPU, coarse on accelerators",
        ),
    ),
    ("random_seed", dict(type=int, help="seed of the seeds given to requests that bring none")),
    (
        "skip_tokenizer_init",
        dict(
            action="store_true",
            help="no tokenizer: /generate takes input_ids and answers output_ids only; the OpenAI routes are refused",
        ),
    ),
    (
        "disable_jump_forward",
        dict(action="store_true", help="decode a grammar's forced text token by token (same output, more steps)"),
    ),
    (
        "grammar_cache_size",
        dict(
            type=int,
            help="compiled regex / JSON-schema grammars kept; 0 rebuilds one per request (the paper's ablation)",
        ),
    ),
    (
        "grammar_compile_timeout",
        dict(type=float, help="seconds one regex / JSON schema may take to compile; longer is a 400 naming the field"),
    ),
    (
        "grammar_backend",
        dict(
            choices=["sgjax", "none", "xgrammar", "outlines", "llguidance"],
            help="regex / JSON-schema backend: sgjax (its compressed FSM with jump-forward) or none "
            "(constrained requests get a 400); SGLang's xgrammar, outlines and llguidance are "
            "refused at start",
        ),
    ),
    (
        "compilation_cache_dir",
        dict(help="JAX's persistent compilation cache, used when JAX_COMPILATION_CACHE_DIR is not set; '' for none"),
    ),
    (
        "gil_switch_interval_ms",
        dict(
            type=float,
            help="Python's thread switch interval while serving (the engine "
            "loop shares the GIL with the HTTP server's threads)",
        ),
    ),
    (
        "disable_overlap_schedule",
        dict(
            action="store_true",
            help="wait for each step's tokens before scheduling the next (no overlap of host work with the steps)",
        ),
    ),
    ("enable_lora", dict(action="store_true", help="serve LoRA adapters (a request's lora_path names one)")),
    (
        "lora_paths",
        dict(nargs="*", help="adapters loaded at start: name=path (an HF PEFT directory) or a bare path"),
    ),
    ("max_loras_per_batch", dict(type=int, help="most distinct adapters in one step (device slots)")),
    (
        "max_lora_rank",
        dict(type=int, help="largest adapter rank served (default: the largest of --lora-paths', else 16)"),
    ),
    (
        "lora_target_modules",
        dict(
            nargs="*",
            help="projections adapters may target: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, or "
            "all (default: those --lora-paths' adapters target, else all)",
        ),
    ),
    ("max_loaded_loras", dict(type=int, help="most adapters loaded at once (default: no limit)")),
    (
        "disaggregation_mode",
        dict(
            choices=["null", "prefill", "decode"],
            help="prefill/decode disaggregation behind sglang-router --pd-disaggregation: prefill runs prompts and "
            "serves their KV pages on the bootstrap port, decode fetches them before decoding; null does both",
        ),
    ),
    ("disaggregation_bootstrap_port", dict(type=int, help="a prefill worker's KV bootstrap port (TCP)")),
    (
        "disaggregation_transfer_backend",
        dict(
            help="how KV pages move between prefill and decode workers: jax (jax.experimental.transfer: pulled from "
            "the prefill worker's device buffers into the decode worker's), socket (their bytes on the bootstrap "
            "connection, through host memory), auto (default: jax where its transfer works in this process, else "
            "socket); a worker whose peer cannot pull (no jax transport, another pool sharding) gets the bytes; "
            "mooncake and nixl are refused",
        ),
    ),
    (
        "tp_size",
        dict(
            type=int,
            help="tensor parallelism: shard the weights and the KV pool by heads over this many "
            "devices (one jitted step over the mesh); with --nnodes, every device of "
            "every host",
        ),
    ),
    (
        "ep_size",
        dict(
            type=int,
            help="expert parallelism (mixtures of experts): 1 or --tp-size; at tp-size each "
            "device holds num_experts / tp-size whole experts instead of a slice of each",
        ),
    ),
    (
        "nnodes",
        dict(type=int, help="hosts (processes) the mesh spans; rank 0 serves HTTP, the others follow its steps"),
    ),
    ("node_rank", dict(type=int, help="this process's rank among --nnodes (0: the server)")),
    (
        "dist_init_addr",
        dict(
            help="host:port of jax.distributed's coordinator on rank 0's host (port + 1 is also "
            "used, for the followers' liveness connections)"
        ),
    ),
    (
        "dist_step_timeout",
        dict(
            type=float,
            help="with --nnodes: seconds rank 0 waits for a follower to acknowledge "
            "a step before failing every request and exiting, as for a dead "
            "follower; 0: no limit",
        ),
    ),
]
