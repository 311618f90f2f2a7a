"""Multi-host tensor parallelism: `--nnodes`, `--node-rank`, `--dist-init-addr` (SGLang's names).

Every process calls `jax.distributed.initialize`, so `jax.devices()` lists every host's devices and the mesh
(engine/mesh.py) spans them all. Rank 0 (the leader) runs the scheduler, the tokenizer and the HTTP server; the other
ranks (followers) load the same weights onto their slice of the mesh and run `follow`: a loop that executes the
same jitted steps, in the same order, as rank 0.

The step protocol (docs/model.md, "Multi-host"). Before every jitted step the leader broadcasts a fixed-size
int32 header (an opcode and the StepShape's fields), then the packed step buffer (and, for a vision step, its image
feature rows), with `multihost_utils.broadcast_one_to_all`: itself a collective, so a follower simply blocks in it
until the next step. Followers never schedule and never sample on their own: the step's outputs are replicated
arrays that only the leader reads. Why a broadcast and not the same deterministic scheduler on every rank: the
scheduler's inputs are the HTTP requests, their arrival order relative to the steps, client aborts and timings
(overlap, grammar compile threads), which would all have to be replicated exactly; one broadcast of a buffer the
leader already builds (a few KB per step) keeps the followers stateless and the host code unchanged.

Encode and score (engine/embed.py) run a jitted prefill of their own over the mesh: the leader broadcasts it as a
READOUT (the readout's kind, then the prompts' token ids), on the engine thread between steps, so every rank meets
the same programs in the same order.

Failure. A follower opens a TCP connection to the leader (the --dist-init-addr host, port + 1) that it holds for
its whole life; the kernel closes it when the follower dies, however it dies, so the leader sees an EOF at once
(a collective with a dead peer may hang, and jax's own heartbeat only notices after heartbeat_timeout_seconds). A
follower that is alive but never joins the collective (SIGSTOP, a hang) keeps the connection open, so each
follower also acknowledges every op it received over it (one byte), and the leader's watcher declares it lost when
an op waits longer than --dist-step-timeout for its acknowledgement (`Acks`). Either way the leader fails every
request with a 500 naming the lost rank and exits with status 1 (`Leader.on_lost`). A follower that loses its
connection to the leader without a STOP exits with status 1 too. A clean shutdown of the leader broadcasts STOP
after the engine loop has ended: the followers leave `follow` and exit 0.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Callable

import numpy as np

from sgjax.engine.step import SHAPE_WORDS, StepShape

log = logging.getLogger("sgjax.distributed")

STEP, RESET, STOP, READOUT = 1, 2, 3, 4
# int32 words: the op, the buffer's size (a READOUT's: its prompts' buffer), then a STEP's StepShape.to_words() and
# its image features' width, or a READOUT's kind (embed.READOUTS).
HEADER = 2 + SHAPE_WORDS + 1
OP, SIZE, SHAPE, FEATURES = 0, 1, slice(2, 2 + SHAPE_WORDS), 2 + SHAPE_WORDS
CONNECT_TIMEOUT = 120.0
# A follower's bytes to the leader: it entered its loop (the clock of its acknowledgements starts: loading and
# compiling before that take as long as they take), and one per op received.
READY, ACK = b"r", b"a"


def parse_addr(addr: str) -> tuple[str, int]:
    host, sep, port = (addr or "").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"dist_init_addr must be host:port, got {addr!r}")
    return host, int(port)


def check_args(args) -> None:
    """One-line errors for the multi-host flags (before anything starts)."""
    if args.nnodes < 1:
        raise ValueError(f"nnodes must be >= 1, got {args.nnodes}")
    if args.nnodes == 1:
        return
    if not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"node_rank must be in [0, {args.nnodes}), got {args.node_rank}")
    if args.dist_init_addr is None:
        raise ValueError("nnodes > 1 needs --dist-init-addr host:port (the coordinator, on the rank-0 host)")
    parse_addr(args.dist_init_addr)
    if not args.dist_step_timeout >= 0:
        raise ValueError(f"dist_step_timeout must be >= 0 seconds (0: no limit), got {args.dist_step_timeout}")


def initialize(args) -> None:
    """jax.distributed over nnodes processes (before jax's backend starts); gloo collectives on CPU."""
    import jax

    check_args(args)
    platforms = os.environ.get("JAX_PLATFORMS", "") or (jax.config.jax_platforms or "")
    if "cpu" in platforms.split(","):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=args.dist_init_addr, num_processes=args.nnodes, process_id=args.node_rank
    )
    log.info(
        "jax.distributed: rank %d of %d, %d local / %d global devices",
        args.node_rank,
        args.nnodes,
        jax.local_device_count(),
        jax.device_count(),
    )


def _keepalive(conn: socket.socket) -> None:
    """A host that vanishes without closing the connection (power, network) is noticed in about 10 s too."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 4), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):  # Linux; elsewhere the system's keepalive timing
            conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _padded(n: int) -> int:
    """The broadcast's length for an n-word buffer: a power of two, so the broadcast compiles a handful of programs
    (one per length) rather than one per step shape."""
    return 1 << max(n - 1, 1).bit_length()


def _broadcast(x: np.ndarray, leader: bool) -> np.ndarray:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(x, is_source=leader))


def agree(value: int, leader: bool) -> int:
    """Rank 0's value of an int on every rank (the pool size: it depends on each host's free memory)."""
    return int(_broadcast(np.asarray([value], np.int32), leader)[0])


def _header(op: int, shape: StepShape | None = None, features=None) -> np.ndarray:
    h = np.zeros(HEADER, np.int32)
    h[OP] = op
    if shape is not None:
        h[SIZE] = shape.size
        h[SHAPE] = shape.to_words()
        h[FEATURES] = 0 if features is None else features.shape[1]
    return h


def _readout_header(kind: int, size: int) -> np.ndarray:
    h = np.zeros(HEADER, np.int32)
    h[OP], h[SIZE], h[SHAPE.start] = READOUT, size, kind
    return h


def pack_prompts(prompts: list[list[int]]) -> np.ndarray:
    """A readout's prompts as one int32 buffer: their count, their lengths, then every token id."""
    return np.asarray([len(prompts), *map(len, prompts), *(t for p in prompts for t in p)], np.int32)


def unpack_prompts(buffer: np.ndarray) -> list[list[int]]:
    n = int(buffer[0])
    ends = np.cumsum(buffer[1 : 1 + n]) + 1 + n
    return [buffer[end - length : end].tolist() for end, length in zip(ends, buffer[1 : 1 + n])]


def _shape(h: np.ndarray) -> StepShape:
    return StepShape.from_words(h[SHAPE])


def roles(args, on_lost: Callable[[str], None]):
    """(Leader, None) on rank 0, (None, Follower) on the others, (None, None) on one host; checks that jax sees
    the processes and devices the flags say (sgjax serve initialises jax.distributed before the engine starts)."""
    if args.nnodes <= 1:
        return None, None
    import jax

    if jax.process_count() != args.nnodes:
        raise ValueError(
            f"nnodes={args.nnodes} but jax sees {jax.process_count()} process(es): call "
            f"sgjax.engine.distributed.initialize first (sgjax serve does)"
        )
    if args.tp_size != jax.device_count():
        raise ValueError(
            f"with nnodes={args.nnodes}, tp_size must be every device of every host "
            f"({jax.device_count()}), got {args.tp_size}"
        )
    return (Leader(args, on_lost=on_lost), None) if args.node_rank == 0 else (None, Follower(args))


class Acks:
    """What each follower acknowledged of the leader's ops, and how long the leader has waited on it. Ops start on
    the engine thread, acknowledgements arrive on each rank's watcher thread: hence the lock."""

    def __init__(self, ranks):
        self._lock = threading.Lock()
        self._sent = 0
        self._started: dict[int, float] = {}  # op number -> when the leader began it, until every rank acked it
        self._acked = dict.fromkeys(ranks, 0)
        self._ready: dict[int, float | None] = dict.fromkeys(ranks)

    def begin(self, now: float) -> None:
        with self._lock:
            self._sent += 1
            self._started[self._sent] = now

    def ready(self, rank: int, now: float) -> None:
        with self._lock:
            self._ready[rank] = now

    def ack(self, rank: int, count: int = 1) -> None:
        with self._lock:
            self._acked[rank] += count
            done = min(self._acked.values())
            for op in [op for op in self._started if op <= done]:
                del self._started[op]

    def waiting(self, rank: int, now: float) -> float:
        """Seconds the leader has waited for `rank`'s oldest unacknowledged op (counted from when the follower
        became ready, if later); 0 when nothing is owed or the follower is still starting."""
        with self._lock:
            oldest, ready = self._acked[rank] + 1, self._ready[rank]
            if ready is None or oldest > self._sent:
                return 0.0
            return now - max(self._started[oldest], ready)


class Leader:
    """Rank 0's side: the followers' connections (watched for EOF and for late acknowledgements) and the op
    broadcasts (engine thread only)."""

    def __init__(self, args, on_lost: Callable[[str], None] | None = None):
        self.nnodes = args.nnodes
        self.on_lost = on_lost
        self.step_timeout = args.dist_step_timeout
        self._closing = False
        host, port = parse_addr(args.dist_init_addr)
        self._listener = socket.create_server((host, port + 1), reuse_port=False)
        self._listener.settimeout(CONNECT_TIMEOUT)
        self._conns: dict[int, socket.socket] = {}
        while len(self._conns) < self.nnodes - 1:
            conn, _ = self._listener.accept()
            conn.settimeout(CONNECT_TIMEOUT)
            rank = int(conn.recv(16).decode().strip() or -1)
            conn.settimeout(None)
            _keepalive(conn)
            self._conns[rank] = conn
        self._listener.close()
        self.acks = Acks(self._conns)
        for rank, conn in self._conns.items():
            threading.Thread(target=self._watch, args=(rank, conn), name=f"sgjax-watch-rank{rank}", daemon=True).start()

    def _watch(self, rank: int, conn: socket.socket) -> None:
        reason = "its process died or its host went away"
        late = False
        # recv wakes up this often to check the acknowledgements' deadline (blocks for ever without one)
        conn.settimeout(min(1.0, self.step_timeout / 4) if self.step_timeout > 0 else None)
        while True:
            try:
                data = conn.recv(64)
            except TimeoutError:
                data = None
            except OSError:
                break
            if data == b"":
                break
            if data:
                if READY in data:
                    self.acks.ready(rank, time.monotonic())
                self.acks.ack(rank, data.count(ACK))
            if self.step_timeout > 0 and self.acks.waiting(rank, time.monotonic()) > self.step_timeout:
                reason = (
                    f"alive but not joining the collective: no acknowledgement of a step for "
                    f"{self.step_timeout:g} s (--dist-step-timeout); stopped or hung"
                )
                late = True
                break
        # A clean stop closes the connections itself; a follower stuck in the STOP broadcast still counts
        if late or not self._closing:
            msg = f"lost follower rank {rank} of {self.nnodes} ({reason})"
            log.error(msg)
            if self.on_lost is not None:
                self.on_lost(msg)
            else:
                os._exit(1)

    def _send(self, header: np.ndarray, buffer: np.ndarray | None = None) -> None:
        self.acks.begin(time.monotonic())
        _broadcast(header, True)
        if buffer is not None:
            padded = np.zeros(_padded(buffer.size), np.int32)
            padded[: buffer.size] = buffer
            _broadcast(padded, True)

    def step(self, shape, buffer: np.ndarray, features: np.ndarray | None) -> None:
        self._send(_header(STEP, shape, features), buffer)
        if shape.image_rows:
            _broadcast(features.astype(np.float32), True)

    def reset(self) -> None:
        self._send(_header(RESET))

    def readout(self, kind: int, prompts: list[list[int]]) -> None:
        buffer = pack_prompts(prompts)
        self._send(_readout_header(kind, buffer.size), buffer)

    def stop(self) -> None:
        """After the engine loop ended: the followers leave `follow` and exit 0."""
        if self._closing:
            return
        self._closing = True
        try:
            self._send(_header(STOP))
        finally:
            for conn in self._conns.values():
                conn.close()


class Follower:
    """A rank > 0: its connection to the leader (an EOF without STOP ends the process with status 1)."""

    def __init__(self, args):
        host, port = parse_addr(args.dist_init_addr)
        deadline = time.monotonic() + CONNECT_TIMEOUT
        while True:
            try:
                self.conn = socket.create_connection((host, port + 1), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self.conn.sendall(f"{args.node_rank}\n".encode())
        self.conn.settimeout(None)
        _keepalive(self.conn)
        self.rank = args.node_rank
        self._stopped = False
        threading.Thread(target=self._watch, name="sgjax-watch-leader", daemon=True).start()

    def _watch(self) -> None:
        try:
            while self.conn.recv(64):
                pass
        except OSError:
            pass
        if not self._stopped:
            log.error("rank %d: lost the leader (rank 0) without a STOP: exiting", self.rank)
            os._exit(1)

    def _tell(self, what: bytes) -> None:
        try:
            self.conn.sendall(what)
        except OSError:  # the leader is gone: the watcher thread ends the process
            pass

    def follow(self, runner) -> int:
        """Execute the leader's steps (and readouts) until STOP; returns the number of steps run. Each op is
        acknowledged once all of it arrived, before it runs: the leader times how long a follower takes to join."""
        from sgjax.engine.embed import READOUTS

        steps = 0
        self._tell(READY)
        while True:
            h = _broadcast(_header(0), False)
            op = int(h[OP])
            size = int(h[SIZE])
            if op == STOP:
                self._stopped = True
                self._tell(ACK)
                log.info("rank %d: STOP after %d steps", self.rank, steps)
                return steps
            if op == RESET:
                self._tell(ACK)
                runner.reset_pool()
                continue
            if op == READOUT:
                buffer = _broadcast(np.zeros(_padded(size), np.int32), False)[:size]
                self._tell(ACK)
                runner.readout(READOUTS[int(h[SHAPE.start])], unpack_prompts(buffer))
                continue
            if op != STEP:
                raise RuntimeError(f"rank {self.rank}: unknown step opcode {op}")
            shape = _shape(h)
            buffer = _broadcast(np.zeros(_padded(size), np.int32), False)[:size]
            features = None
            if shape.image_rows:
                features = _broadcast(np.zeros((shape.image_rows, int(h[FEATURES])), np.float32), False)
            self._tell(ACK)
            runner.execute(buffer, shape, features)
            steps += 1
