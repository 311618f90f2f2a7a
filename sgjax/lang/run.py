"""Batches of programs: one program per argument dict in a thread pool, after the tracer pre-caches the prefix
every program starts with (the paper's compiler-mode batch optimisation)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from sgjax.lang.global_config import global_config
from sgjax.lang.interpreter import StreamExecutor, run_program
from sgjax.lang.state import ProgramState
from sgjax.lang.tracer import cache_common_prefix


def run_program_batch(
    function, backend, batch_kwargs: list[dict], defaults: dict, num_threads="auto", progress_bar: bool = False
) -> list[ProgramState]:
    """Run one program per argument dict in a thread pool; states come back in order. A program whose code
    raised returns a state that raises the error where it is used (one bad input does not sink the batch)."""
    if global_config.enable_precache_with_tracing and len(batch_kwargs) > 1:
        cache_common_prefix(function, backend, batch_kwargs)
    if num_threads == "auto":
        num_threads = max(32, (os.cpu_count() or 1) * 16)
    num_threads = max(1, min(int(num_threads), len(batch_kwargs)))

    def one(kwargs):
        try:
            return run_program(function, backend, (), kwargs, defaults, sync=True)
        except Exception as e:
            executor = StreamExecutor(backend, defaults)
            executor.fail_from_program(e)
            executor.end()
            return ProgramState(executor)

    bar = None
    if progress_bar:
        import tqdm

        bar = tqdm.tqdm(total=len(batch_kwargs))
    with ThreadPoolExecutor(num_threads) as pool:
        futures = [pool.submit(one, kw) for kw in batch_kwargs]
        if bar is not None:
            for f in futures:
                f.add_done_callback(lambda _: bar.update())
        states = [f.result() for f in futures]
    if bar is not None:
        bar.close()
    return states
