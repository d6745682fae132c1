"""Unit tests of the vectorized page allocator."""

from __future__ import annotations

import numpy as np
import pytest

from kvserve.memsvc.allocator import OutOfSlots, PageAllocator


def test_never_hands_out_slot_zero_and_all_slots_unique() -> None:
    a = PageAllocator(17)
    got = np.concatenate([a.alloc(4) for _ in range(4)])
    assert sorted(got.tolist()) == list(range(1, 17))
    assert a.free_slots == 0
    with pytest.raises(OutOfSlots):
        a.alloc(1)


def test_free_then_alloc_reuses() -> None:
    a = PageAllocator(9)
    s = a.alloc(8)
    a.free(s[:3])
    assert a.free_slots == 3
    assert sorted(a.alloc(3).tolist()) == sorted(s[:3].tolist())


def test_pages() -> None:
    a = PageAllocator(32, page_size=4)
    s = a.alloc(8)
    assert len(s) == 8 and np.all(s >= 4)
    assert np.all(s.reshape(-1, 4) % 4 == np.arange(4))  # whole aligned pages
    with pytest.raises(ValueError, match="multiple of page_size"):
        a.alloc(3)
    a.free(s)
    assert a.free_slots == 28


def test_bad_sizes() -> None:
    with pytest.raises(ValueError):
        PageAllocator(10, page_size=4)
    with pytest.raises(ValueError):
        PageAllocator(1)


def test_overfree_is_refused() -> None:
    a = PageAllocator(5)
    with pytest.raises(ValueError, match="more pages"):
        a.free(np.array([1, 2], dtype=np.int64))
