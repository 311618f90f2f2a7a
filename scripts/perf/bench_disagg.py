"""One room's KV hand-off between a prefill and a decode pool, over each transport (engine/disagg.py): from the
decode side's ask on the bootstrap socket to the pages scattered into its pool, with the prefill side's gather
done beforehand (as when the request finished). Both pools live in this process on one device; the bytes still go
over loopback TCP either way, so the numbers are the transports' own costs, not a network's.

    PYTHONPATH=. python scripts/perf/bench_disagg.py                       # Llama-3-8B's KV, a 2048-token prompt
    PYTHONPATH=. python scripts/perf/bench_disagg.py --layers 30 --kv-heads 3 --head-dim 64   # SmolLM2-135M's
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from sgjax.engine import disagg_transfer
from sgjax.engine.disagg import BootstrapServer, KvStore, fetch, gather_pages, scatter_pages
from sgjax.engine.disagg_transfer import DeviceTransfer, unavailable
from sgjax.server.process import free_ports


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=2048, help="the prompt's whole pages' tokens")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--chunk-mib", type=int, default=disagg_transfer.CHUNK_BYTES >> 20, help="jax's copy chunk")
    ap.add_argument("--copies", type=int, default=disagg_transfer.COPIES, help="jax's chunks in flight")
    args = ap.parse_args()
    disagg_transfer.CHUNK_BYTES, disagg_transfer.COPIES = args.chunk_mib << 20, args.copies
    pages = args.tokens // args.page_size
    shape = (args.layers, 2 * pages + 1, args.page_size, 2 * args.kv_heads, args.head_dim)
    dtype = jnp.dtype(args.dtype)
    src = jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(dtype)
    dst = jnp.zeros(shape, dtype)
    src_pages = np.arange(1, pages + 1, dtype=np.int32)
    dst_pages = np.arange(pages + 1, 2 * pages + 1, dtype=np.int32)[::-1].copy()
    want = np.asarray(src[:, src_pages[:3]].astype(jnp.float32))
    nbytes = args.layers * pages * args.page_size * 2 * args.kv_heads * args.head_dim * dtype.itemsize
    backends = ["socket"] + (["jax"] if unavailable() is None else [])
    out = {"device": jax.devices()[0].device_kind, "jax_version": jax.__version__, "pages": pages}
    out.update(mib=nbytes / 2**20, chunk_mib=args.chunk_mib, copies=args.copies)
    for backend in backends:
        store = KvStore()
        (port,) = free_ports(1)
        offer = DeviceTransfer(src) if backend == "jax" else None
        server = BootstrapServer(store, "127.0.0.1", port, offer)
        puller = DeviceTransfer(dst) if backend == "jax" else None
        times, fetched = [], []
        for i in range(args.repeat + 1):  # the first one compiles the gathers and scatters and connects
            kv = gather_pages(src, src_pages)
            jax.block_until_ready(kv)
            store.put(i, [0] * args.tokens, kv)
            start = time.perf_counter()
            tokens, got = fetch("127.0.0.1", port, i, 60.0, puller)
            fetched.append(time.perf_counter() - start)
            dst = scatter_pages(dst, dst_pages, got)
            dst.block_until_ready()
            times.append(time.perf_counter() - start)
        server.close()
        check = np.asarray(dst[:, dst_pages[:3]].astype(jnp.float32))
        assert np.array_equal(check, want), backend
        dst = jnp.zeros(shape, dtype)
        t, f = statistics.median(times[1:]), statistics.median(fetched[1:])
        out[backend] = {"ms": round(t * 1e3, 2), "fetch_ms": round(f * 1e3, 2), "gb_s": round(nbytes / t / 1e9, 2)}
        out[backend]["first_ms"] = round(times[0] * 1e3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
