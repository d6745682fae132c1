"""Slot allocator: a vectorized free list of pages over the KV pool.

A page is `page_size` consecutive slots; page 0 (which holds the reserved padding slot 0)
is never handed out. The free list is a numpy stack of page ids, so allocating or freeing
a batch costs a few array operations, not a Python loop per slot.

This module knows nothing about requests, prefixes or policies.
"""

from __future__ import annotations

import numpy as np


class OutOfSlots(Exception):
    """Raised by `alloc` when fewer free slots remain than asked for."""


class PageAllocator:
    """Hands out slots in whole pages; slot ids are int64 numpy arrays."""

    def __init__(self, size: int, page_size: int = 1) -> None:
        if page_size < 1 or size % page_size or size // page_size < 2:
            raise ValueError(f"size {size} must be a multiple of page_size {page_size}, >= 2 pages")
        self.size = size
        self.page_size = page_size
        self.n_pages = size // page_size
        self._stack = np.empty(self.n_pages - 1, dtype=np.int64)
        self._offsets = np.arange(page_size, dtype=np.int64)
        self.reset()

    def reset(self) -> None:
        """Mark every page but page 0 free (lowest ids are handed out first)."""
        self._stack[:] = np.arange(self.n_pages - 1, 0, -1, dtype=np.int64)
        self._top = self.n_pages - 1

    @property
    def free_slots(self) -> int:
        return self._top * self.page_size

    @property
    def usable_slots(self) -> int:
        return (self.n_pages - 1) * self.page_size

    def alloc(self, n_slots: int) -> np.ndarray:
        """Return `n_slots` slots (a multiple of page_size, page-contiguous), or raise OutOfSlots."""
        ps = self.page_size
        if n_slots % ps:
            raise ValueError(f"{n_slots} slots is not a multiple of page_size {ps}")
        n_pages = n_slots // ps
        if n_pages > self._top:
            raise OutOfSlots(f"asked for {n_slots} slots, {self.free_slots} free")
        start = self._top - n_pages
        pages = self._stack[start:self._top][::-1].copy()
        self._top = start
        if ps == 1:
            return pages
        return (pages[:, None] * ps + self._offsets).reshape(-1)

    def free(self, slots: np.ndarray) -> None:
        """Return slots (whole pages, as given out by `alloc`) to the free list."""
        if len(slots) == 0:
            return
        pages = slots if self.page_size == 1 else slots[:: self.page_size] // self.page_size
        n = len(pages)
        if self._top + n > len(self._stack):
            raise ValueError("free() of more pages than were allocated")
        self._stack[self._top:self._top + n] = pages
        self._top += n

    def free_page_ids(self) -> np.ndarray:
        """A copy of the free pages (for integrity checks)."""
        return self._stack[: self._top].copy()

    def set_free_pages(self, pages: np.ndarray) -> None:
        """Replace the free list (integrity repair)."""
        pages = np.asarray(pages, dtype=np.int64)
        self._stack[: len(pages)] = pages
        self._top = len(pages)
