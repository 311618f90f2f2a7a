"""Prefill/decode disaggregation, SGLang's way (--disaggregation-mode prefill|decode behind sglang-router's
--pd-disaggregation): the router sends each request to a prefill worker and a decode worker at once, with the same
`bootstrap_room` and the prefill worker's `bootstrap_host` / `bootstrap_port`.

- The prefill worker runs the prompt (one token: the decode worker makes the output), and as the request finishes
  takes its prompt's whole KV pages from its pool and keeps them for the room (`KvStore`); a bootstrap server on
  --disaggregation-bootstrap-port hands them to whoever asks for the room, waiting for them if need be.
- The decode worker asks the prefill worker's bootstrap server for the room before it queues the request, writes
  the pages into fresh pages of its own pool and inserts them into its radix cache under the prompt's tokens. The
  request then runs as any other: its prefix is a cache hit, and it computes only what was not sent (the last
  partial page and the last token, whose logits give the first output token).

So the decode worker's outputs are a single engine's with a cache hit (the same KV, bit for bit), and a transfer
that fails or comes late costs only recomputation: the request prefills what it lacks.

The pages travel one of two ways (--disaggregation-transfer-backend): `socket` sends their bytes on the bootstrap
connection (host memory on both sides); `jax` offers them as device arrays through `jax.experimental.transfer`
(engine/disagg_transfer.py) and the bootstrap answer says only where to pull them, straight into the decode
worker's device. `auto` (the default) is `jax` where that transfer works in this process, else `socket`. Each side
asks or offers its own way: a `jax` decode worker asks for a pull, and a prefill worker offers one when it runs the
jax transport too and its pool is sharded as the asker's; otherwise the bytes come on the socket. A room's pages
move as runs of power-of-two page counts, so the transfers carry no padding and reuse the compiled gathers and
scatters.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import socket
import socketserver
import struct
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from sgjax.engine.buckets import bucket
from sgjax.engine.disagg_transfer import DeviceTransfer, unavailable

log = logging.getLogger("sgjax.engine")
MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("auto", "jax", "socket")
_HEADER = struct.Struct("!Q")


class KvStore:
    """The prefill side's finished rooms: room -> (prompt token ids of the whole pages, their KV as device arrays
    [L, n, ...], one per run of `runs`) until the decode worker takes it, or `ttl` seconds pass."""

    def __init__(self, ttl: float = 300.0):
        self._rooms: dict[int, tuple[float, list[int], object]] = {}
        self._cond = threading.Condition()
        self.ttl = ttl

    def put(self, room: int, tokens: list[int], kv) -> None:
        with self._cond:
            now = time.monotonic()
            for r in [r for r, (t, _, _) in self._rooms.items() if now - t > self.ttl]:
                del self._rooms[r]
            self._rooms[room] = (now, tokens, kv)
            self._cond.notify_all()

    def take(self, room: int, timeout: float):
        """(tokens, kv) of the room, waiting up to `timeout` seconds; None if it never came."""
        with self._cond:
            if not self._cond.wait_for(lambda: room in self._rooms, timeout):
                return None
            _, tokens, kv = self._rooms.pop(room)
        return tokens, kv

    def __len__(self) -> int:
        return len(self._rooms)


def _send(sock, header: dict, payload: bytes = b"") -> None:
    head = json.dumps(header).encode()
    sock.sendall(_HEADER.pack(len(head)) + head + _HEADER.pack(len(payload)))
    sock.sendall(payload)


def _recv_exact(sock, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 22))
        if not chunk:
            raise ConnectionError("the bootstrap connection closed mid-message")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv(sock) -> tuple[dict, bytes]:
    (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    header = json.loads(_recv_exact(sock, n))
    (m,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    return header, _recv_exact(sock, m)


class BootstrapServer(socketserver.ThreadingTCPServer):
    """The prefill worker's bootstrap server: one request per connection, `{"room": r, "timeout": s}` (and a jax
    decode worker's `via`, `streams`, `layout`), answered with the room's tokens and either where to pull the KV
    from (`transfer`'s offer) or its dtype and shape, then its bytes (an empty answer when the room never came)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, store: KvStore, host: str, port: int, transfer: DeviceTransfer | None = None):
        self.store = store
        self.transfer = transfer
        super().__init__((host, port), _Handler)
        self.thread = threading.Thread(target=self.serve_forever, name="sgjax-bootstrap", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(socketserver.BaseRequestHandler):
    def handle(self):
        try:
            ask, _ = _recv(self.request)
            timeout = float(ask.get("timeout", 60))
            found = self.server.store.take(int(ask["room"]), timeout)
            if found is None or not found[0]:
                _send(self.request, {"tokens": []})
                return
            tokens, kv = found
            transfer = self.server.transfer
            if transfer is not None and transfer.can_offer(ask, kv):
                here = self.request.getsockname()[0]  # an address the decode worker reaches us at
                try:
                    offer = transfer.offer(here, int(ask["room"]), kv, timeout + 10)
                    _send(self.request, {"tokens": tokens, **offer})
                    return
                except jax.errors.JaxRuntimeError as e:  # no transfer server here: the bytes still go
                    log.warning("room %s: no KV transfer offer (%s); sending the bytes", ask["room"], e)
            host = np.concatenate(jax.device_get(kv), axis=1)
            _send(self.request, {"tokens": tokens, "dtype": host.dtype.name, "shape": list(host.shape)}, host.tobytes())
        except (OSError, ValueError, KeyError) as e:  # a client gone or malformed: nothing else depends on it
            log.warning("bootstrap request failed: %s", e)


def fetch(
    host: str, port: int, room: int, timeout: float = 60.0, transfer: DeviceTransfer | None = None
) -> tuple[list[int], np.ndarray | list | None]:
    """The decode side: the room's prompt tokens and KV from the prefill worker's bootstrap server ([] and None when
    it has none). The KV is pulled through `transfer` when the prefill worker offers it so (a list of device arrays,
    one per run of `runs`), else it comes as bytes ([L, pages, ...] in host memory)."""
    with socket.create_connection((host, int(port)), timeout=timeout + 10) as sock:
        _send(sock, {"room": int(room), "timeout": timeout, **(transfer.ask() if transfer is not None else {})})
        header, payload = _recv(sock)
    if not header["tokens"]:
        return [], None
    if header.get("via") == "jax":
        if transfer is None:
            raise ConnectionError("the prefill worker offered a pull this worker did not ask for")
        return header["tokens"], transfer.pull(header, timeout)
    kv = np.frombuffer(payload, dtype=jnp.dtype(header["dtype"])).reshape(header["shape"])
    return header["tokens"], kv


@jax.jit
def _gather(pool, pages):
    return pool[:, pages]


@functools.partial(jax.jit, donate_argnums=0)
def _scatter(pool, pages, kv):
    return pool.at[:, pages].set(kv.astype(pool.dtype))


def padded(pages: np.ndarray) -> np.ndarray:
    """Page ids padded with the null page 0 to a power-of-two count: a few compiled gathers and scatters."""
    out = np.zeros(bucket(len(pages), 1), np.int32)
    out[: len(pages)] = pages
    return out


def runs(n: int) -> list[tuple[int, int]]:
    """[start, stop) runs of n pages, each a power of two long, longest first (13: 8, 4, 1)."""
    out, start = [], 0
    while start < n:
        stop = start + (1 << ((n - start).bit_length() - 1))
        out.append((start, stop))
        start = stop
    return out


def gather_pages(pool, pages: np.ndarray) -> list:
    """KV of `pages`, one device array [L, stop - start, ...] per run (nothing leaves the device here)."""
    return [_gather(pool, jnp.asarray(pages[a:b], jnp.int32)) for a, b in runs(len(pages))]


def page_count(kv) -> int:
    return sum(p.shape[1] for p in kv) if isinstance(kv, list) else kv.shape[1]


def scatter_pages(pool, pages: np.ndarray, kv):
    """`pool` with `kv` written at `pages`: the runs' device arrays (pulled), or one host array [L, len(pages), ...]
    (from the socket; padded to a power of two, the padding rows going to the null page)."""
    if isinstance(kv, list):
        for (a, b), piece in zip(runs(len(pages)), kv, strict=True):
            pool = _scatter(pool, jnp.asarray(pages[a:b], jnp.int32), piece)
        return pool
    full = np.zeros((kv.shape[0], bucket(len(pages), 1)) + kv.shape[2:], kv.dtype)
    full[:, : len(pages)] = kv
    return _scatter(pool, jnp.asarray(padded(pages)), jnp.asarray(full))


def check_disagg_args(args) -> str:
    """The worker's mode, refusing by name what it cannot be run with."""
    mode = args.disaggregation_mode or "null"
    if mode not in MODES:
        raise ValueError(f"--disaggregation-mode must be one of {list(MODES)}, got {mode!r}")
    if args.disaggregation_transfer_backend not in TRANSFER_BACKENDS:
        raise ValueError(
            f"--disaggregation-transfer-backend {args.disaggregation_transfer_backend!r} is not supported: sgjax "
            f"moves KV pages with {', '.join(TRANSFER_BACKENDS)}"
        )
    if mode != "null" and args.nnodes > 1:
        raise ValueError("--disaggregation-mode across hosts (--nnodes > 1) is not supported")
    if mode == "decode" and (args.disable_radix_cache or args.cache == "none"):
        raise ValueError("--disaggregation-mode decode needs the prefix cache: the prompt's pages arrive through it")
    return mode


def transfer_backend(args) -> str:
    """`jax` or `socket`: the one named, or for `auto` jax where its transfer works here. A named jax that cannot
    work is refused with the reason."""
    backend = args.disaggregation_transfer_backend
    if backend == "socket":
        return backend
    why = unavailable()
    if why is None:
        return "jax"
    if backend == "jax":
        raise ValueError(f"--disaggregation-transfer-backend jax cannot run here: {why}; use socket")
    log.info("KV pages go over the bootstrap socket: %s", why)
    return "socket"


class DisaggControl:
    """The Engine's part in disaggregation; the state it reads (args, scheduler, runner, outputs) is the Engine's."""

    disagg_mode = "null"
    kv_store: KvStore | None = None
    _bootstrap: BootstrapServer | None = None
    transfer: DeviceTransfer | None = None  # the jax transport (None: pages go over the socket)
    disagg_timeout = 60.0  # seconds a decode worker waits for a room's pages before it computes them itself
    received_tokens = 0  # prompt tokens whose pages a decode worker got from prefill workers
    socket_kv_bytes = 0  # bytes of pages that came over the bootstrap socket (decode)

    def _start_disagg(self, args) -> None:
        self.disagg_mode = check_disagg_args(args)
        if self.disagg_mode == "null":
            return
        if transfer_backend(args) == "jax":
            self.transfer = DeviceTransfer(self.runner.state.pool)
            if self.disagg_mode == "decode":
                self.transfer.server("0.0.0.0")  # a server that cannot start fails the engine's start, not a request
        if self.disagg_mode == "prefill":
            self.kv_store = KvStore()
            port = args.disaggregation_bootstrap_port
            self._bootstrap = BootstrapServer(self.kv_store, "0.0.0.0", port, self.transfer)
            log.info("prefill worker: bootstrap server on port %d", port)

    def _stop_disagg(self) -> None:
        if self._bootstrap is not None:
            self._bootstrap.close()
            self._bootstrap = None
        if self.transfer is not None:
            self.transfer.close()

    def _disagg_report(self) -> dict:
        return {
            "disaggregation_mode": self.disagg_mode,
            "disaggregation_bootstrap_port": self.args.disaggregation_bootstrap_port,
            "disaggregation_received_tokens": self.received_tokens,
            "disaggregation_transfer_backend": "jax" if self.transfer is not None else "socket",
            "disaggregation_pulls": 0 if self.transfer is None else self.transfer.pulls,
            "disaggregation_offers": 0 if self.transfer is None else self.transfer.offers,
            "disaggregation_socket_kv_bytes": self.socket_kv_bytes,
        }

    def _disaggregate(self, reqs) -> None:
        """On the caller's thread, once a call's requests are built: a prefill worker marks them for export (one
        token each: the decode worker makes the output); a decode worker fetches each room's pages and puts them
        in its cache before the requests queue."""
        if self.disagg_mode == "prefill":
            for req in reqs:
                if req.bootstrap is not None:
                    req.export_room = int(req.bootstrap[2])
                    req.params = dataclasses.replace(req.params, max_new_tokens=1)
        elif self.disagg_mode == "decode":
            done = set()
            for req in reqs:
                if req.bootstrap is None or req.bootstrap[2] in done:
                    continue
                done.add(req.bootstrap[2])
                host, port, room = req.bootstrap
                try:
                    tokens, kv = fetch(host, port, room, self.disagg_timeout, self.transfer)
                except OSError as e:  # the prefill worker is gone, or its pages never came: computed here
                    log.warning("room %s: no pages from %s:%s (%s); prefilling here", room, host, port, e)
                    continue
                if isinstance(kv, np.ndarray):
                    self.socket_kv_bytes += kv.nbytes
                if kv is not None and tokens == req.input_ids[: len(tokens)]:
                    self.received_tokens += self._call(lambda t=tokens, k=kv: self._import_pages(t, k))

    def _export_pages(self, req, aborted: bool = False) -> None:
        """On the engine thread, as a prefill request finishes: its prompt's whole cached pages, kept for its room
        (nothing for an aborted one: the decode worker then computes the prompt itself, without waiting)."""
        if aborted:
            self.kv_store.put(req.export_room, [], None)
            return
        sched = self.scheduler
        whole = len(req.input_ids) // sched.page_size * sched.page_size
        m = sched.cache.match_prefix(np.asarray(req.input_ids[:whole], np.int32), sched._namespace(req))
        kv = gather_pages(self.runner.state.pool, np.asarray(m.pages)) if m.num_tokens else None
        self.kv_store.put(req.export_room, req.input_ids[: m.num_tokens], kv)

    def _import_pages(self, tokens: list[int], kv) -> int:
        """On the engine thread: a room's pages (pulled device arrays or socket bytes) written into fresh pages of the
        pool and cached under their tokens. Returns the tokens taken (0 when the pool has no room for them now)."""
        sched = self.scheduler
        need = page_count(kv)
        pages = sched.allocator.alloc(need)
        if pages is None:
            sched.cache.evict(need - sched.allocator.num_free)
            pages = sched.allocator.alloc(need)
            if pages is None:
                return 0
        runner = self.runner
        runner.state = dataclasses.replace(runner.state, pool=scatter_pages(runner.state.pool, pages, kv))
        key = None if sched.generation == 0 else (None, sched.generation)
        sched.cache.insert(np.asarray(tokens, np.int32), pages, key)  # pages already cached are freed again
        return len(tokens)
