"""`ServerArgs`: every engine setting, with SGLang's names (sgjax.cli gives each one a flag)."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class ServerArgs:
    """Engine settings, with SGLang's names (the paper's ablations are switches here)."""

    model_path: str | None = None
    # auto: the checkpoint's weights; dummy: random weights of the checkpoint's config (an HF directory's
    # config.json), with its tokenizer: serving benchmarks of large shapes where the weights are not at hand.
    load_format: str = "auto"
    dtype: str | None = None  # float32 | bfloat16; default: float32 on CPU, bfloat16 on accelerators
    page_size: int = 16
    max_total_tokens: int | None = None  # KV pool size; default: mem_fraction_static of free device memory
    mem_fraction_static: float = 0.8
    max_running_requests: int = 64
    chunked_prefill_size: int = 512
    schedule_policy: str = "lpm"
    schedule_conservativeness: float = 1.0  # scales the admission reserve for future tokens; 0: admit greedily
    disable_radix_cache: bool = False
    cache: str = "radix"  # radix | table (the "no tree" ablation) | none
    attention_backend: str | None = None  # ref | pallas; default by platform
    context_length: int | None = None
    max_top_logprobs_num: int = 20
    precompile: bool | None = None  # compile the common step shapes at start; default: on accelerators only
    # Step-shape ladder: fine (R, L, K fitted to each batch: CPU, where compiles are cheap) or coarse (the shape
    # follows the token count: accelerators, where a compile costs seconds); default by platform.
    step_buckets: str | None = None
    random_seed: int = 0
    skip_tokenizer_init: bool = False  # input_ids in, output_ids out, no text (dummy-weight benchmarks)
    disable_jump_forward: bool = False  # decode forced grammar text token by token (same output, more steps)
    grammar_cache_size: int = 128  # compiled grammars kept; 0 rebuilds per request (the paper's ablation)
    # JAX's persistent compilation cache, used when the process has not configured one (JAX_COMPILATION_CACHE_DIR
    # or jax.config): restarts then load the step's executables instead of compiling them again.
    compilation_cache_dir: str | None = "~/.cache/sgjax/jax"
    # The engine's loop is a thread that shares the GIL with the caller's threads (the frontend's programs, the
    # HTTP server). Each step gives the GIL up at every device call and waits up to Python's switch interval
    # (5 ms) to get it back from a busy thread: with 4 busy threads a tiny model's step took 119 ms at 5 ms and
    # 21 ms at 0.5 ms (scripts/bench_gil.py). Process-wide; None leaves the interpreter's setting alone.
    gil_switch_interval_ms: float | None = 0.5
    # Overlap (SGLang's default too): while step k runs on the device, the host commits step k-1 and its streams,
    # and step k+1 reads k's tokens on the device. Only decode steps whose requests need no host-side token state
    # (no grammar, no penalties) overlap; the rest run one after the other.
    disable_overlap_schedule: bool = False

    @classmethod
    def from_kwargs(cls, model_path, kwargs: dict) -> "ServerArgs":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
        return cls(model_path=model_path, **kwargs)
