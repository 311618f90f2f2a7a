"""The CPU's native products behind the step plan (engine/plan.py matmul "native"): the weights' dense matrices,
embedding and LM head packed in panels for kernels/cpu_matmul.cc, and the forward's `Ops` over them
(with norms summed in one fixed order, llama.tree_sum).

Every product of a step goes through the one kernel, whatever its row count (a decode row or a 512-token prefill),
so a row's arithmetic never depends on the rest of its step: the batch invariance docs/engine.md promises. The
scanned forward passes each stacked matrix whole with the layer's index (llama.Indexed); the kernel reads that
layer where it lies.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sgjax.kernels.cpu import cpu_matmul
from sgjax.kernels.cpu_pack import PackedMatrix, pack_float, pack_int4, pack_int8
from sgjax.model.llama import Indexed, Ops, tree_sum
from sgjax.model.quant import Int4Matrix, Int8Matrix
from sgjax.model.weights import DENSE_LEAVES, Weights


def native_dots(h, matrices, out_dtype=None, tied: bool = False):
    """h @ each packed matrix in one kernel call (they share h, and a scanned layer's index)."""
    picked = [m.index for m in matrices if isinstance(m, Indexed)]
    mats = [m.stacked if isinstance(m, Indexed) else m for m in matrices]
    outs = cpu_matmul(h, picked[0] if picked else 0, mats)
    return [out.astype(out_dtype or h.dtype) for out in outs]


NATIVE = Ops(native_dots, in_place=True, row_sum=tree_sum)


def pack(a, rows_first: bool) -> PackedMatrix:
    """One matrix leaf packed: float [.., in, out] (or [.., out, in] where rows_first: the embedding), or
    quantized ([.., out, in] always)."""
    if isinstance(a, PackedMatrix):
        return a
    if isinstance(a, Int4Matrix):
        return pack_int4(a.q, a.scale)
    if isinstance(a, Int8Matrix):
        return pack_int8(a.q, a.scale)
    host = np.asarray(a)
    return pack_float(host if rows_first else np.swapaxes(host, -1, -2))


def pack_weights(weights: Weights) -> Weights:
    """The weights as the native forward reads them: stacked layers' dense matrices, the embedding and the LM head
    packed; norms, biases, the router and experts as they are."""
    if isinstance(weights.layers, (tuple, list)):
        raise ValueError("pack_weights takes stacked layers (the native forward scans them)")
    layers = dataclasses.replace(
        weights.layers,
        **{
            n: pack(getattr(weights.layers, n), rows_first=False)
            for n in DENSE_LEAVES
            if getattr(weights.layers, n, None) is not None
        },
    )
    top = {"embed": pack(weights.embed, rows_first=True)}
    if weights.lm_head is not None:
        top["lm_head"] = pack(weights.lm_head, rows_first=False)
    return dataclasses.replace(weights, layers=layers, **top)


def packed(weights: Weights) -> bool:
    return isinstance(weights.embed, PackedMatrix)
