"""Query blocks of a ragged batch: which rows each kernel program owns (installed as sgjax.kernels.ragged_blocks).

A GPU kernel over a ragged batch runs one program per block of `block_q` query rows, and a block
never spans two requests (so it has one page table and one causal offset). Request r needs
ceil(q_len / block_q) blocks, so a batch of T rows and R requests needs at most
ceil(T / block_q) + R + 1 blocks: that static count is the grid, and programs past the real
number of blocks find no rows and store nothing. The padded rows past cu_q_lens[-1] form one extra
pseudo-request with kv_len 0, so the kernel writes zeros there instead of leaving the output
uninitialised (the contract asks for finite padded rows).

Computed with a few XLA ops on i32[R] vectors, so the kernel needs no binary search and no scalar
prefetch (Pallas-Triton has none).
"""

from __future__ import annotations

import jax.numpy as jnp

from sgjax.kernels.metadata import AttentionMetadata

# Columns of the block table.
ROW_START, ROW_END, POS_OFFSET, REQUEST = range(4)
NUM_FIELDS = 4


def batch_dims(q, pool, meta: AttentionMetadata):
    """The sizes every paged-attention wrapper starts from: (rows T, query heads, head_dim, layers, pages per
    layer, page_size, KV heads, group Hq/Hkv, requests R, pages per request P)."""
    num_rows, num_heads, head_dim = q.shape
    num_layers, num_pages, page_size, num_combined, _ = pool.shape
    num_kv_heads = num_combined // 2
    num_reqs, pages_per_req = meta.page_table.shape
    return (
        num_rows,
        num_heads,
        head_dim,
        num_layers,
        num_pages,
        page_size,
        num_kv_heads,
        num_heads // num_kv_heads,
        num_reqs,
        pages_per_req,
    )


def num_blocks(num_rows: int, num_reqs: int, block_q: int, align: int = 1) -> int:
    """Static upper bound on the blocks any batch of this shape needs (R requests + the padding)."""
    return -(-(num_rows + (align - 1) * (num_reqs + 1)) // block_q) + num_reqs + 1


def block_table(meta: AttentionMetadata, num_rows: int, block_q: int, include=None):
    """i32[num_blocks, 4]: for each block its first row, its request's end row, the offset that turns
    a row index into its absolute position (pos = row + offset), and its request (for the page table).

    Unused blocks get row_start == row_end == 0, i.e. no rows and no keys. `include` (bool[R + 1], the last
    entry the padding rows) keeps only those requests' blocks: two kernels can then split one batch.
    """
    return aligned_block_table(meta, num_rows, block_q, align=1, include=include)[0]


def aligned_block_table(meta: AttentionMetadata, num_rows: int, block_q: int, align: int, include=None):
    """block_table with every block starting at a multiple of `align` rows (TMA tiles need 8), and i32[num_blocks]
    holding each block's request's (or the padding's) first row.

    A request's first block then starts up to align - 1 rows early, inside the previous request: the kernel
    computes those rows but must not store them (they are below the first row).
    """
    num_reqs = meta.kv_lens.shape[0]
    cu = meta.cu_q_lens.astype(jnp.int32)
    starts = cu  # R real requests, then the padding pseudo-request starting at cu[-1]
    lens = jnp.concatenate([cu[1:] - cu[:-1], jnp.int32(num_rows) - cu[-1:]])
    kv_lens = jnp.concatenate([meta.kv_lens.astype(jnp.int32), jnp.zeros((1,), jnp.int32)])
    first = starts - starts % align
    wanted = lens > 0 if include is None else (lens > 0) & include
    blocks = jnp.where(wanted, (starts + lens - first + block_q - 1) // block_q, 0)
    ends = jnp.cumsum(blocks)
    b = jnp.arange(num_blocks(num_rows, num_reqs, block_q, align), dtype=jnp.int32)
    # The request of block b is the number of requests whose blocks end at or before b. Counted by
    # one compare-and-sum fusion: jnp.searchsorted's default is a loop, which on a GPU costs a kernel
    # launch and a device-to-host sync per step (docs/journal/kernels-h200.md).
    req = jnp.sum(ends[None, :] <= b[:, None], axis=1, dtype=jnp.int32)
    used = req <= num_reqs
    req = jnp.minimum(req, num_reqs)
    first_block = ends[req] - blocks[req]
    row_start = first[req] + (b - first_block) * block_q
    row_end = starts[req] + lens[req]
    # New tokens sit at positions [kv_len - q_len, kv_len); the padding has kv_len 0, so every one of
    # its positions is negative and no key is attended.
    pos_offset = kv_lens[req] - lens[req] - starts[req]
    table = jnp.stack([row_start, row_end, pos_offset, jnp.minimum(req, num_reqs - 1)], axis=1)
    return jnp.where(used[:, None], table, 0).astype(jnp.int32), jnp.where(used, starts[req], 0)


def long_requests(meta: AttentionMetadata, min_rows: int):
    """bool[R + 1]: the requests with at least min_rows new rows, and True for the padding pseudo-request."""
    cu = meta.cu_q_lens.astype(jnp.int32)
    return jnp.concatenate([cu[1:] - cu[:-1] >= min_rows, jnp.ones((1,), bool)])


def row_mask(meta: AttentionMetadata, num_rows: int, per_request):
    """bool[T]: per_request (bool[R + 1], the last entry the padding rows) spread over each request's rows."""
    # Request of each row by a cumulative count of request starts: O(T), no T x R compare.
    starts = jnp.zeros((num_rows + 1,), jnp.int32).at[meta.cu_q_lens[1:].astype(jnp.int32)].add(1)
    return per_request[jnp.cumsum(starts)[:num_rows]]
