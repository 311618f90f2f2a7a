import chex
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgjax.cache import NULL_PAGE, PageAllocator

SETTINGS = settings(derandomize=True, deadline=None, max_examples=60, database=None)


def test_fresh_pool_hands_out_pages_in_order_and_never_the_null_page():
    a = PageAllocator(6)
    assert a.capacity == 5 and a.num_free == 5
    chex.assert_trees_all_equal(a.alloc(3), np.array([1, 2, 3], np.int32))
    chex.assert_trees_all_equal(a.alloc(2), np.array([4, 5], np.int32))
    assert a.alloc(1) is None and a.num_free == 0


def test_alloc_failure_takes_nothing():
    a = PageAllocator(4)
    assert a.alloc(4) is None
    assert a.num_free == 3


@pytest.mark.parametrize(
    "bad", [[NULL_PAGE], [9], [-1], [1, 1]], ids=["null", "out-of-range", "negative", "same-page-twice"]
)
def test_free_rejects_invalid_pages(bad):
    a = PageAllocator(8)
    a.alloc(3)
    with pytest.raises(ValueError):
        a.free(bad)
    assert a.num_free == 4  # a rejected call frees nothing


def test_double_free_is_caught():
    a = PageAllocator(8)
    p = a.alloc(2)
    a.free(p)
    with pytest.raises(ValueError, match="double free"):
        a.free(p[:1])


def test_tiny_pool_rejected():
    with pytest.raises(ValueError):
        PageAllocator(1)


@SETTINGS
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 9)), max_size=80))
def test_random_alloc_free_never_loses_or_duplicates_a_page(ops):
    a = PageAllocator(17)
    held: list[int] = []
    for is_alloc, n in ops:
        if is_alloc:
            p = a.alloc(n)
            if p is None:
                assert n > a.num_free
                continue
            chex.assert_shape(p, (n,))
            held.extend(p.tolist())
        else:
            k = min(n, len(held))
            a.free(held[:k])
            del held[:k]
        assert len(set(held)) == len(held) and NULL_PAGE not in held
        assert sorted(held + a.free_pages().tolist()) == list(range(1, 17))
        assert a.is_allocated(held)
