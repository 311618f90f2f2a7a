"""Process-wide switches of the frontend (SGLang's `sgl.global_config`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GlobalConfig:
    default_backend: object = None
    # fork(n > 1) first sends the prompt so far as a prefill-only request, then starts the branches (the paper's
    # frontend hint); off for the ablation.
    enable_frontend_hint: bool = True
    # False: every `s += ...` waits until it ran, so fork branches and a program's calls go to the backend one at
    # a time (the paper's "no frontend parallelism" ablation; run_batch with num_threads=1 does the rest).
    enable_parallelism: bool = True
    # run_batch traces the program and caches its constant prefix before starting the programs.
    enable_precache_with_tracing: bool = True
    precache_min_chars: int = 64  # shorter prefixes are not worth a request (SGLang's threshold)


global_config = GlobalConfig()
