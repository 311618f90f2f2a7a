"""Start the server: load the engine, warm it up, serve HTTP with uvicorn until SIGTERM or SIGINT.

Shutdown on a signal: the engine stops first (in a background thread, so the signal handler returns at once); its
loop finishes every running and waiting request with an abort, open streams send their last chunk and `[DONE]`,
uvicorn's graceful shutdown then finds no busy connection, and the process exits with status 0.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time

import uvicorn

from sgjax.engine import distributed
from sgjax.engine.engine import Engine, ServerArgs
from sgjax.server.app import build_app
from sgjax.server.connection import check_port, header_timeout_protocol
from sgjax.server.serving import HttpArgs, Serving

log = logging.getLogger("sgjax.server")


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, serving: Serving):
        super().__init__(config)
        self.serving = serving

    def handle_exit(self, sig, frame) -> None:
        self.serving.begin_shutdown()
        super().handle_exit(sig, frame)


def serve(server_args: ServerArgs, http: HttpArgs) -> None:
    logging.basicConfig(level=http.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    distributed.check_args(server_args)
    follower = server_args.nnodes > 1 and server_args.node_rank > 0
    if not follower:
        check_port(http.host, http.port)  # fail before the model loads, not after
    signal.signal(signal.SIGTERM, _exit_while_loading)
    if server_args.nnodes > 1:  # before anything starts jax's backend
        distributed.initialize(server_args)
    log.info("loading the engine: %s", server_args.model_path or "the default SmolLM2")
    t0 = time.perf_counter()
    kwargs = {f.name: getattr(server_args, f.name) for f in dataclasses.fields(server_args) if f.name != "model_path"}
    engine = Engine(server_args.model_path, **kwargs)
    if follower:  # no HTTP: execute rank 0's steps until its STOP, then exit 0
        log.info("rank %d: following rank 0", server_args.node_rank)
        steps = engine.follow()
        log.info("rank %d: stopped after %d steps", server_args.node_rank, steps)
        import jax

        jax.distributed.shutdown()
        return
    serving = Serving(engine, http)
    if not http.skip_server_warmup:
        _warm_up(engine)
    log.info(
        "engine ready in %.1f s: %s, pool %d tokens, context %d",
        time.perf_counter() - t0,
        serving.model_name,
        engine.max_total_tokens,
        engine.context_length,
    )
    config = uvicorn.Config(
        build_app(serving),
        host=http.host,
        port=http.port,
        log_level=http.log_level,
        access_log=http.log_requests,
        timeout_graceful_shutdown=10,
        http=header_timeout_protocol(http.header_timeout),
    )
    # After its graceful shutdown uvicorn restores the previous handlers and raises the signal again; a no-op
    # handler there lets the process end normally, with status 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    _Server(config, serving).run()


def _exit_while_loading(sig, frame):
    # Nothing is served yet, so nothing can be lost. A SystemExit raised here could be swallowed (Python ignores
    # exceptions raised inside a garbage-collector callback) or wait for the precompile threads to finish their
    # shapes (seconds each on a GPU): end the process now.
    log.info("signal %d while loading: exiting", sig)
    os._exit(0)


def _warm_up(engine: Engine) -> None:
    """One short request compiles (or loads from the persistent cache) the first prefill and decode steps, so the
    first client does not pay for them; the cache is flushed after."""
    ids = engine.tokenizer.encode("Hello") if engine.tokenizer is not None else [1, 2, 3]
    engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 2, "temperature": 0.0})
    engine.flush_cache()
