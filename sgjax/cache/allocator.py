"""Free-list allocator over the pages of the preallocated KV pool.

Page 0 is the null page: padded writes land there and padded page-table entries point there, so it is never
handed out. `free` is the only way a page goes back to the pool; every cache calls it (eviction, duplicate pages
on insert, NoCache's insert), which is why it checks for double frees instead of trusting its callers.
"""

from __future__ import annotations

import numpy as np

NULL_PAGE = 0
EMPTY_PAGES = np.zeros(0, dtype=np.int32)
EMPTY_PAGES.flags.writeable = False


class PageAllocator:
    """LIFO free list of page indices 1..num_pages-1 (recently freed pages are reused first)."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        self.num_pages = int(num_pages)
        # The top of the stack is the end of the array; a fresh pool hands out 1, 2, 3, ... (readable tests).
        self._stack = np.arange(self.num_pages - 1, 0, -1, dtype=np.int32)
        self._top = self.num_pages - 1
        # Mirror of the free list for O(len(pages)) double-free and use-after-free checks.
        self._is_free = np.ones(self.num_pages, dtype=bool)
        self._is_free[NULL_PAGE] = False

    @property
    def capacity(self) -> int:
        """Pages that can ever be allocated (the null page excluded)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return self._top

    def alloc(self, n: int) -> np.ndarray | None:
        """`n` distinct pages as an int32 array, or None when fewer than `n` are free (nothing is taken then)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self._top:
            return None
        out = self._stack[self._top - n : self._top][::-1].copy()
        self._top -= n
        self._is_free[out] = False
        return out

    def free(self, pages) -> None:
        """Return pages to the pool. The single free point of the whole runtime."""
        pages = np.asarray(pages, dtype=np.int32).ravel()
        n = len(pages)
        if n == 0:
            return
        if pages.min() <= NULL_PAGE or pages.max() >= self.num_pages:
            raise ValueError(f"freeing an invalid page (null or out of range): {pages.tolist()}")
        if self._is_free[pages].any():
            raise ValueError(f"double free of pages {pages[self._is_free[pages]].tolist()}")
        if n > 1:
            s = np.sort(pages)  # far cheaper than np.unique on the eviction path
            if (s[1:] == s[:-1]).any():
                raise ValueError("the same page appears twice in one free() call")
        self._is_free[pages] = True
        self._stack[self._top : self._top + n] = pages
        self._top += n

    def is_allocated(self, pages) -> bool:
        """True when every page is a real page currently owned by someone (not free, not null)."""
        pages = np.asarray(pages, dtype=np.int32).ravel()
        if len(pages) == 0:
            return True
        if pages.min() <= NULL_PAGE or pages.max() >= self.num_pages:
            return False
        return not self._is_free[pages].any()

    def free_pages(self) -> np.ndarray:
        """A copy of the free list (for invariant checks and tests, not the hot path)."""
        return self._stack[: self._top].copy()
