"""Prefill/decode disaggregation's device transport (--disaggregation-transfer-backend jax, and `auto` where it
works): a room's KV pages go from the prefill worker's device buffers into the decode worker's through
`jax.experimental.transfer`; the bootstrap socket (engine/disagg.py) carries only where to pull them from.

The API, the same in jax 0.10.x and 0.11.x (transfer.py and jaxlib's py_socket_transfer.cc are unchanged between
0.10.2 and 0.11.x): `start_transfer_server(client, address, transport_addresses, max_num_parallel_copies,
transfer_size)` gives a TransferServer with `address()`, `await_pull(uuid, arrays, timeout)` (offer arrays once)
and `connect(address)`, a TransferConnection with `pull(uuid, specs, timeout)` (the arrays at once, filled as the
bytes arrive) and `_poison_connection()`. XLA copies each device buffer in chunks through host memory it mapped for
DMA and sends the chunks over TCP; the receiver copies them into fresh device buffers. No Python sees the bytes.

What shapes this module (seen on jax 0.10.2, CPU, and read in the C++):
- A server without transport addresses (the default) moves bytes only within one process: a connection from
  another one aborts it (a failed CHECK). Both sides always name one.
- The puller connects to the transport address the server announces, so a wildcard one is unreachable from another
  host (and a refused connect is again an abort): the prefill worker starts a server on the address the decode
  worker reached its bootstrap server at, on first use (one per such address).
- An offer is pulled once; one never pulled is dropped after its timeout. A pull of an offer that is gone, or from
  a dead peer, never ends, whatever its `timeout`: a timer poisons the connection instead, which fails every pull
  on it, and the connection is dropped (they are kept per peer: a new one costs ~6 ms, a pull on one ~0.3 ms).
- A pull lands in one device buffer per addressable shard of the given sharding, in the offer's order: a
  tensor-parallel pool's pages move shard to shard when both workers split the pool alike (the same `layout`:
  device count and shards per axis); otherwise the pages go over the socket.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import socket
import threading

import jax

log = logging.getLogger("sgjax.engine")
STREAMS = 1  # TCP connections a pull's bytes share; the puller needs as many as the server has (it binds one each)
# A copy chunk and the chunks in flight: the server maps 3 * COPIES chunks of host memory for DMA (768 MiB). On an
# H100 this moves pages as fast as jax's default (256 MiB x 8, 6 GiB mapped, seconds to start); 16 MiB was slower
# (scripts/perf/bench_disagg.py).
CHUNK_BYTES = 32 << 20
COPIES = 8
_SO_ZEROCOPY = getattr(socket, "SO_ZEROCOPY", 60)  # Linux's; Python names it on some builds only


def unavailable() -> str | None:
    """Why jax's transfer cannot carry KV pages in this process (None when it can)."""
    try:
        from jax.experimental import transfer
    except ImportError as e:
        return f"jax {jax.__version__} has no jax.experimental.transfer ({e})"
    if not hasattr(transfer, "start_transfer_server") or not hasattr(transfer.TransferConnection, "_poison_connection"):
        return f"jax {jax.__version__}'s jax.experimental.transfer lacks start_transfer_server or connection poisoning"
    try:  # XLA's transfer sockets CHECK this option: a kernel without it (Linux < 4.14, some sandboxes) aborts us
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, _SO_ZEROCOPY, 1)
    except OSError as e:
        return f"this kernel refuses SO_ZEROCOPY, which jax's transfer sockets require ({e})"
    return None


def layout(array) -> str:
    """How a KV array (or the pool) is split over its devices: the device count and the shards per axis. A pull needs
    the offer's shards in the same order and shapes."""
    shard = array.sharding.shard_shape(array.shape)
    return f"{len(array.sharding.device_set)}:{[n // s for n, s in zip(array.shape, shard)]}"


def _deadline(seconds: float) -> datetime.datetime:
    return datetime.datetime.now() + datetime.timedelta(seconds=seconds)


def _host_port(host: str) -> str:
    return f"[{host}]:0" if ":" in host else f"{host}:0"


class DeviceTransfer:
    """One worker's side: a prefill worker offers rooms' pages (`offer`), a decode worker pulls them (`pull`) into
    buffers of its pool's sharding."""

    def __init__(self, pool):
        self.sharding = pool.sharding  # where pulled pages land (the same after every pool reset)
        self.layout = layout(pool)
        self._client = next(iter(self.sharding.device_set)).client
        self._servers: dict[str, object] = {}  # local address -> TransferServer
        self._connections: dict[str, object] = {}  # a prefill worker's server address -> TransferConnection
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self.offers = 0  # rooms offered (prefill)
        self.pulls = 0  # rooms pulled (decode)
        self.pulled_bytes = 0

    def server(self, host: str):
        """The transfer server on `host` (a decode worker's, on 0.0.0.0, only makes connections), started once."""
        from jax.experimental import transfer

        with self._lock:
            if host not in self._servers:
                addr = _host_port(host)
                self._servers[host] = transfer.start_transfer_server(
                    self._client, addr, [addr] * STREAMS, max_num_parallel_copies=COPIES, transfer_size=CHUNK_BYTES
                )
                log.info("KV transfer server on %s", self._servers[host].address())
            return self._servers[host]

    def ask(self) -> dict:
        """What a decode worker tells the bootstrap server, so it offers the pages only where a pull can take them."""
        return {"via": "jax", "streams": STREAMS, "layout": self.layout}

    def can_offer(self, ask: dict, kv: list) -> bool:
        return ask.get("via") == "jax" and ask.get("streams") == STREAMS and ask.get("layout") == layout(kv[0])

    def offer(self, host: str, room: int, kv: list, timeout: float) -> dict:
        """Offer a room's KV pieces for one pull through a server on `host` (the address the decode worker reached
        us at); returns what the decode worker needs to pull them. The offer lapses after `timeout` seconds."""
        server = self.server(host)
        uuid = (int(room) & (2**47 - 1)) << 16 | next(self._seq) & 0xFFFF  # the room's, unique per offer
        server.await_pull(uuid, kv, timeout=_deadline(timeout))
        self.offers += 1
        shapes = [list(p.shape) for p in kv]
        return {"via": "jax", "address": server.address(), "uuid": uuid, "shapes": shapes, "dtype": kv[0].dtype.name}

    def pull(self, header: dict, timeout: float) -> list:
        """A room's KV pieces from the offer `header` names, in device buffers of the pool's sharding; raises
        ConnectionError when they do not come within `timeout` seconds."""
        address = header["address"]
        with self._lock:
            conn = self._connections.get(address)
        if conn is None:
            host, _, port = address.rpartition(":")
            # A connection to nobody retries every 2 s for good, even poisoned: only a live server gets one.
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
            conn = self.server("0.0.0.0").connect(address)
            with self._lock:
                conn = self._connections.setdefault(address, conn)
        dtype = jax.numpy.dtype(header["dtype"])
        specs = [jax.ShapeDtypeStruct(tuple(s), dtype, sharding=self.sharding) for s in header["shapes"]]
        timer = threading.Timer(timeout, conn._poison_connection)  # a pull that never ends fails instead
        timer.daemon = True
        timer.start()
        try:
            kv = conn.pull(int(header["uuid"]), specs, timeout=_deadline(timeout))
            jax.block_until_ready(kv)
        except jax.errors.JaxRuntimeError as e:
            with self._lock:
                if self._connections.get(address) is conn:
                    del self._connections[address]
            raise ConnectionError(f"pull {header['uuid']} from {address} failed: {e}") from e
        finally:
            timer.cancel()
        self.pulls += 1
        self.pulled_bytes += sum(p.nbytes for p in kv)
        return kv

    def close(self) -> None:
        """Stop the servers (dropping one closes its port and its offers) and forget the connections."""
        with self._lock:
            self._servers.clear()
            self._connections.clear()
