"""build_batch (vectorised) against a per-request loop that states the layout directly."""

import numpy as np
import pytest

from sgjax.model.batch import build_batch


def _loop(chunks, kv_lens, tables, page_size, num_tokens, num_reqs, pages_per_req):
    ids, pos, slots = (np.zeros(num_tokens, np.int32) for _ in range(3))
    cu, lens = np.zeros(num_reqs + 1, np.int32), np.zeros(num_reqs, np.int32)
    table = np.zeros((num_reqs, pages_per_req), np.int32)
    t = 0
    for r, (chunk, kv_len, pages) in enumerate(zip(chunks, kv_lens, tables)):
        p = np.arange(kv_len - len(chunk), kv_len)
        ids[t : t + len(chunk)] = chunk
        pos[t : t + len(chunk)] = p
        slots[t : t + len(chunk)] = np.asarray(pages)[p // page_size] * page_size + p % page_size
        table[r, : len(pages)] = pages
        lens[r] = kv_len
        t += len(chunk)
        cu[r + 1] = t
    cu[len(chunks) + 1 :] = t
    return ids, pos, slots, cu, lens, table


@pytest.mark.parametrize("seed", range(6))
def test_matches_the_per_request_layout(seed):
    rng = np.random.default_rng(seed)
    page_size, num_reqs, pages_per_req = int(rng.choice([4, 16])), 8, 12
    n = int(rng.integers(1, num_reqs + 1))
    q_lens = rng.integers(1, 9, n) if seed % 2 else np.ones(n, int)  # mixed prefill/extend, or all decode
    kv_lens = [int(q + rng.integers(0, page_size * pages_per_req - q)) for q in q_lens]
    pages = rng.permutation(np.arange(1, 200))
    tables, used = [], 0
    for kv in kv_lens:
        k = -(-kv // page_size) + int(rng.integers(0, 2))  # sometimes a spare page past the last token
        k = min(k, pages_per_req)
        tables.append([int(x) for x in pages[used : used + k]])
        used += k
    chunks = [list(rng.integers(0, 1000, q)) for q in q_lens]
    num_tokens = int(sum(q_lens)) + int(rng.integers(0, 5))
    batch = build_batch(chunks, kv_lens, tables, page_size, num_tokens, num_reqs, pages_per_req)
    ids, pos, slots, cu, lens, table = _loop(chunks, kv_lens, tables, page_size, num_tokens, num_reqs, pages_per_req)
    np.testing.assert_array_equal(batch.input_ids, ids)
    np.testing.assert_array_equal(batch.positions, pos)
    np.testing.assert_array_equal(batch.attn.slot_mapping, slots)
    np.testing.assert_array_equal(batch.attn.cu_q_lens, cu)
    np.testing.assert_array_equal(batch.attn.kv_lens, lens)
    np.testing.assert_array_equal(batch.attn.page_table, table)
    np.testing.assert_array_equal(batch.logits_idx[:n], cu[1 : n + 1] - 1)
    assert all(
        a.dtype == np.int32
        for a in (batch.input_ids, batch.positions, batch.attn.slot_mapping, batch.attn.page_table, batch.logits_idx)
    )


def test_short_page_table_names_the_request():
    with pytest.raises(ValueError, match="request 1: 1 pages cannot hold 9 tokens"):
        build_batch([[1], [2]], [3, 9], [[1], [2]], 8, 16, 4, 4)
