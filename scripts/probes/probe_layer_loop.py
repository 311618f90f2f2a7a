"""Probe: does scanning over stacked layer weights cost extra HBM traffic at decode on the GPU?

Decode is weight-bandwidth bound, so a per-layer copy of the weight slice (dynamic-slice before the
matmul) would show as ~2-3x the ideal time. Times four ways of looping 32 Llama-3-8B-sized MLP+QKV
layers over a [16, 4096] bf16 activation:
  scan-xs      lax.scan with the stacked weights as xs (what sgjax.model.llama does)
  fori-index   fori_loop indexing the stacked weights with the loop counter
  unrolled     a Python loop over per-layer arrays (compile time grows with depth)
  scan-xs+dsf  scan-xs with XLA's dynamic-slice fusion enabled (child process; flag read at start-up)
Prints ms per call and the ratio to weight bytes / measured copy bandwidth.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "perf"))
from roofline import copy_bandwidth, time_fn  # noqa: E402

L, D, F = 32, 4096, 14336


def make():
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    w = {"wqkv": jax.random.normal(k[0], (L, D, 6144), jnp.bfloat16) * 0.01,
         "w_up": jax.random.normal(k[1], (L, D, 2 * F), jnp.bfloat16) * 0.01,
         "w_down": jax.random.normal(k[2], (L, F, D), jnp.bfloat16) * 0.01}
    x = jax.random.normal(k[3], (16, D), jnp.bfloat16)
    return w, x


def layer(x, w):
    h = x + (x @ w["wqkv"])[:, :D]
    gu = h @ w["w_up"]
    return x + (jax.nn.silu(gu[:, :F]) * gu[:, F:]) @ w["w_down"]


def scan_xs(w, x):
    return jax.lax.scan(lambda x, wl: (layer(x, wl), None), x, w)[0]


def fori_index(w, x):
    return jax.lax.fori_loop(0, L, lambda i, x: layer(x, jax.tree.map(lambda a: a[i], w)), x)


def unrolled(ws, x):
    for wl in ws:
        x = layer(x, wl)
    return x


def main():
    w, x = make()
    nbytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(w))
    bw = copy_bandwidth()
    rows = []
    variants = {"scan-xs": (scan_xs, w), "fori-index": (fori_index, w)}
    if len(sys.argv) < 2:
        variants["unrolled"] = (unrolled, [jax.tree.map(lambda a: a[i], w) for i in range(L)])
    for name, (fn, ws) in variants.items():
        f = jax.jit(fn)
        ms = time_fn(f, ws, x) * 1e3
        name = name + (sys.argv[1] if len(sys.argv) > 1 else "")
        rows.append({"variant": name, "ms": ms, "ideal_ms": nbytes / bw * 1e3, "ratio": nbytes / bw * 1e3 / ms})
        print(json.dumps(rows[-1]), flush=True)
    if len(sys.argv) < 2:
        env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_dynamic_slice_fusion=true")
        subprocess.run([sys.executable, __file__, "+dsf"], env=env, check=False)


if __name__ == "__main__":
    main()
