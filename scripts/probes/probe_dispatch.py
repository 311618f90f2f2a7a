"""Does launching a step wait for the device? On the H200 the engine's `dispatch` took as long as the step itself
(bench_engine's profile: 1.58 s of host dispatch in a 1.86 s span), so the overlap loop could not hide host work.
This times, while a ~50 ms program runs on the device, each part of a dispatch alone: the host->device transfer of
a step-sized numpy buffer (jnp.asarray; device_put to pinned host memory), a jitted call on a device-resident input,
and a jitted call that takes a fresh numpy buffer. Prints one line per case and writes JSON (--out)."""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/probe_dispatch.json")
    ap.add_argument("--n", type=int, default=8192, help="matrix size of the busy program")
    args = ap.parse_args()
    x = jax.random.normal(jax.random.PRNGKey(0), (args.n, args.n), jnp.bfloat16)

    @jax.jit
    def busy(x):
        for _ in range(60):
            x = (x @ x) * jnp.bfloat16(1e-2)
        return x

    small = jax.jit(lambda buf, y: y + buf.sum())
    host = np.arange(40000, dtype=np.int32)  # a step buffer's size (tokens, tables, sampling rows)
    dev = jnp.asarray(host)
    y = jnp.zeros((), jnp.int32)
    jax.block_until_ready((busy(x), small(dev, y)))
    rows = []

    def case(name, fn, repeats=5):
        waits, totals = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            r = busy(x)
            t1 = time.perf_counter()
            out = fn()
            t2 = time.perf_counter()
            jax.block_until_ready((r, out))
            t3 = time.perf_counter()
            waits.append(t2 - t1)
            totals.append(t3 - t0)
        row = {"case": name, "call_ms": 1e3 * float(np.median(waits)), "busy_program_ms": 1e3 * float(np.median(totals))}
        rows.append(row)
        print(f"{name:48s} returns after {row['call_ms']:8.3f} ms (the busy program takes {row['busy_program_ms']:.1f} ms)",
              flush=True)

    case("nothing (baseline)", lambda: None)
    case("jnp.asarray(numpy buffer)", lambda: jnp.asarray(host))
    case("jax.device_put(numpy buffer)", lambda: jax.device_put(host))
    try:
        sh = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
        case("device_put(numpy, pinned_host memory)", lambda: jax.device_put(host, sh))
    except Exception as e:  # noqa: BLE001
        print(f"pinned_host: {type(e).__name__}: {e}")
    case("jitted call, device input", lambda: small(dev, y))
    case("jitted call, numpy input", lambda: small(host, y))
    case("jitted call, jnp.asarray(numpy) input", lambda: small(jnp.asarray(host), y))
    # The sampler's lax.cond on flags that travel in the step's buffer: on XLA:GPU a conditional's predicate is read
    # back to the host to pick the branch, which waits for everything queued before it on the stream.
    cond_fn = jax.jit(lambda buf, y: jax.lax.cond(buf[0] > 0, lambda: y + buf.sum(), lambda: y - 1))
    jax.block_until_ready(cond_fn(dev, y))
    case("jitted call with lax.cond on an input flag", lambda: cond_fn(dev, y))
    where_fn = jax.jit(lambda buf, y: jnp.where(buf[0] > 0, y + buf.sum(), y - 1))
    jax.block_until_ready(where_fn(dev, y))
    case("jitted call with jnp.where instead", lambda: where_fn(dev, y))
    z = busy(x)
    case("jitted call on the busy program's output", lambda: small(dev, z.sum().astype(jnp.int32)))
    with open(args.out, "w") as f:
        json.dump({"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "rows": rows}, f)


if __name__ == "__main__":
    main()
