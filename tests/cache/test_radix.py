"""Behaviour of RadixCache, TableCache and NoCache on small hand-made cases."""

import chex
import numpy as np
import pytest

from sgjax.cache import NoCache, PageAllocator, PrefixCache, RadixCache, TableCache


def _put(cache, tokens, extra_key=None):
    """Engine-like: reuse matched pages, allocate the rest, insert."""
    m = cache.match_prefix(tokens, extra_key)
    pages = np.concatenate([m.pages, cache.allocator.alloc(len(tokens) // cache.page_size - len(m.pages))])
    return cache.insert(tokens, pages, extra_key), pages


def test_match_is_the_longest_cached_prefix_and_splits_the_edge():
    c = RadixCache(PageAllocator(32))
    _, pages = _put(c, [1, 2, 3, 4, 5])
    m = c.match_prefix([1, 2, 3, 9, 9])
    assert m.num_tokens == 3
    chex.assert_trees_all_equal(m.pages, pages[:3])
    chex.assert_trees_all_equal(m.last_node.tokens, np.array([1, 2, 3], np.int32))
    assert c.num_nodes == 2  # [1,2,3] -> [4,5]
    c.check_invariants()


def test_insert_of_a_diverging_sequence_shares_the_common_edge():
    c = RadixCache(PageAllocator(32))
    _put(c, [1, 2, 3, 4])
    already, _ = _put(c, [1, 2, 7, 8, 9])
    assert already == 2
    assert c.cached_pages == 4 + 3
    assert c.match_prefix([1, 2, 7, 8, 9, 10]).num_tokens == 5
    assert c.match_prefix([1, 2, 3, 4]).num_tokens == 4
    c.check_invariants()


def test_insert_frees_the_callers_duplicate_pages_but_not_the_cached_ones():
    a = PageAllocator(32)
    c = RadixCache(a)
    _, first = _put(c, [5, 6, 7])
    fresh = a.alloc(4)  # recomputed [5,6,7] instead of matching, plus one new token
    assert c.insert([5, 6, 7, 8], fresh) == 3
    assert set(fresh[:3].tolist()) <= set(a.free_pages().tolist())
    chex.assert_trees_all_equal(c.match_prefix([5, 6, 7, 8]).pages, np.append(first, fresh[3]))
    c.check_invariants()


def test_page_size_matches_whole_pages_only():
    c = RadixCache(PageAllocator(32), page_size=2)
    with pytest.raises(ValueError, match="whole pages"):
        c.insert([1, 2, 3], [7])
    _put(c, [1, 2, 3, 4, 5, 6])
    assert c.match_prefix([1, 2, 3, 4, 5]).num_tokens == 4  # the odd tail token is never matched
    assert c.match_prefix([1, 2, 3, 9, 5, 6]).num_tokens == 2  # divergence inside a page drops the page
    assert c.match_prefix([1, 9]).num_tokens == 0
    c.check_invariants()


def test_namespaces_never_share():
    c = RadixCache(PageAllocator(32))
    _put(c, [1, 2, 3], extra_key="image-a")
    assert c.match_prefix([1, 2, 3]).num_tokens == 0
    assert c.match_prefix([1, 2, 3], extra_key="image-b").num_tokens == 0
    assert c.match_prefix([1, 2, 3], extra_key="image-a").num_tokens == 3
    c.flush()
    assert "image-a" not in c._roots  # empty namespaces are dropped
    c.check_invariants()


def test_locked_pages_survive_eviction_and_their_parent_follows_its_last_child():
    a = PageAllocator(32)
    c = RadixCache(a)
    _put(c, [1, 2, 3, 4])
    _put(c, [1, 2, 5, 6])
    node = c.match_prefix([1, 2, 3, 4]).last_node
    c.lock(node)
    assert (c.protected_pages, c.evictable_pages) == (4, 2)
    assert c.evict(100) == 2  # only the unlocked leaf [5,6]; [1,2] still has a locked child
    c.check_invariants()
    c.unlock(node)
    assert c.evict(1) == 2  # leaf [3,4] goes whole
    assert c.match_prefix([1, 2, 3]).num_tokens == 2
    assert c.evict(1) == 2  # now [1,2] is a leaf itself
    assert a.num_free == a.capacity
    c.check_invariants()


def test_eviction_is_least_recently_used_first():
    c = RadixCache(PageAllocator(32))
    for first in (1, 2, 3):
        _put(c, [first, 0, 0])
    c.match_prefix([1, 0, 0])  # 1 is now the most recent, 2 the least
    c.evict(1)
    assert [c.match_prefix([k, 0, 0]).num_tokens for k in (1, 2, 3)] == [3, 0, 3]


def test_unlock_without_lock_and_lock_of_evicted_node_raise():
    c = RadixCache(PageAllocator(32))
    _put(c, [1, 2])
    node = c.match_prefix([1, 2]).last_node
    with pytest.raises(ValueError):
        c.unlock(node)
    c.flush()
    with pytest.raises(ValueError, match="evicted"):
        c.lock(node)


def test_reset_returns_everything_and_refuses_while_locked():
    a = PageAllocator(16)
    c = RadixCache(a)
    _put(c, [1, 2, 3])
    m = c.match_prefix([1, 2, 3])
    c.lock(m.last_node)
    with pytest.raises(ValueError):
        c.reset()
    c.unlock(m.last_node)
    c.reset()
    assert a.num_free == a.capacity and c.cached_pages == 0 and c.match_prefix([1, 2, 3]).num_tokens == 0
    c.check_invariants()


def test_insert_rejects_pages_it_already_owns():
    a = PageAllocator(16)
    c = RadixCache(a)
    _, pages = _put(c, [1, 2])
    with pytest.raises(ValueError, match="already owned"):
        c.insert([1, 3, 4], np.array([pages[0], pages[1], a.alloc(1)[0]]))
    with pytest.raises(ValueError):
        c.insert([9, 9], np.array([0, a.alloc(1)[0]]))  # the null page is never cached


def test_table_cache_hits_only_on_whole_stored_sequences():
    c = TableCache(PageAllocator(64))
    _put(c, [1, 2, 3, 4])  # a few-shot prompt + question 1
    assert c.match_prefix([1, 2, 3, 9]).num_tokens == 0  # a sibling shares [1,2,3] but no tree: no hit
    assert c.match_prefix([1, 2, 3, 4, 5, 6]).num_tokens == 4  # the next chat turn hits
    already, _ = _put(c, [1, 2, 3, 4, 5, 6])
    assert already == 4 and c.cached_pages == 6  # the new entry owns only its two new pages
    c.check_invariants()
    assert c.evict(1) == 2  # the extension goes first: its base is not a leaf while it exists
    assert c.match_prefix([1, 2, 3, 4, 5, 6]).num_tokens == 4
    c.check_invariants()


def test_table_cache_insert_under_an_independent_longer_entry_keeps_the_matched_pages():
    # Found on the H200 (HellaSwag, no_tree): a request matched a short entry, while a longer entry with the same
    # start had been stored before it, on its own pages. Inserting the request's tokens under the longer entry
    # freed the short entry's pages, which the short entry still owned: a double free, then a tree with free pages.
    a = PageAllocator(64)
    c = TableCache(a)
    _put(c, [1, 2, 3, 4, 5, 6])
    _put(c, [1, 2, 3])  # shorter than the first, so it cannot extend it: its own pages
    m = c.match_prefix([1, 2, 3, 4])  # a prompt that hits only the short entry
    assert m.num_tokens == 3
    c.lock(m.last_node)
    free_before = a.num_free
    own = a.alloc(3)
    assert c.insert([1, 2, 3, 4, 5, 6], np.concatenate([m.pages, own])) == 6  # it generated the long one's tokens
    assert a.num_free == free_before  # only the request's own three pages went back
    c.check_invariants()
    c.unlock(m.last_node)
    assert c.match_prefix([1, 2, 3]).num_tokens == 3
    c.check_invariants()


def test_no_cache_reuses_nothing_and_frees_at_once():
    a = PageAllocator(8)
    c = NoCache(a)
    assert c.insert([1, 2, 3], a.alloc(3)) == 0
    assert a.num_free == a.capacity and c.match_prefix([1, 2, 3]).num_tokens == 0
    c.check_invariants()


@pytest.mark.parametrize("cls", [RadixCache, TableCache, NoCache])
def test_all_caches_implement_the_protocol(cls):
    assert isinstance(cls(PageAllocator(4)), PrefixCache)
