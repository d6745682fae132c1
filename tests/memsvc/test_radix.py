"""Unit tests of the radix prefix cache."""

from __future__ import annotations

import numpy as np
import pytest

from kvserve.memsvc.radix import RadixCache


def arr(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


def test_match_insert_split() -> None:
    t = RadixCache()
    assert t.insert(arr(1, 2, 3, 4), arr(11, 12, 13, 14)) == 0
    m = t.match_prefix(arr(1, 2, 9), count=True)
    assert m.slots.tolist() == [11, 12]
    assert t.queried_tokens == 3 and t.hit_tokens == 2
    assert t.insert(arr(1, 2, 5), arr(21, 22, 25)) == 2  # caller keeps 21, 22
    assert t.total_size == 5
    assert t.match_prefix(arr(1, 2, 5, 6)).slots.tolist() == [11, 12, 25]
    assert t.match_prefix(arr(7)).node is t.root


def test_lock_protects_from_eviction_and_lru_order() -> None:
    t = RadixCache()
    t.insert(arr(1, 2), arr(1, 2))
    t.insert(arr(3, 4), arr(3, 4))
    t.insert(arr(5, 6), arr(5, 6))
    locked = t.match_prefix(arr(1, 2)).node
    t.lock(locked)
    t.match_prefix(arr(5, 6))  # touch: 3,4 is now least recently used
    assert t.evictable_size == 4
    assert sorted(t.evict(1).tolist()) == [3, 4]
    assert sorted(t.evict(10).tolist()) == [5, 6]
    assert t.evict(10).size == 0
    assert t.match_prefix(arr(1, 2)).slots.tolist() == [1, 2]
    t.unlock(locked)
    assert t.evictable_size == 2
    with pytest.raises(RuntimeError):
        t.unlock(locked)


def test_evict_parent_after_children() -> None:
    t = RadixCache()
    t.insert(arr(1, 2, 3), arr(1, 2, 3))
    t.insert(arr(1, 2, 4), arr(1, 2, 4))
    freed = t.evict(100)
    assert sorted(freed.tolist()) == [1, 2, 3, 4]
    assert t.total_size == 0 and not t.root.children


def test_page_aligned() -> None:
    t = RadixCache(page_size=2)
    t.insert(arr(1, 2, 3, 4), arr(4, 5, 6, 7))
    assert t.match_prefix(arr(1, 2, 3)).slots.tolist() == [4, 5]
    assert t.match_prefix(arr(1, 2, 3, 9)).slots.tolist() == [4, 5]
    assert t.insert(arr(1, 2, 3, 9), arr(4, 5, 8, 9)) == 2
    assert t.match_prefix(arr(1, 2, 3, 9)).slots.tolist() == [4, 5, 8, 9]
    with pytest.raises(ValueError, match="page-aligned"):
        t.insert(arr(1, 2, 3), arr(1, 2, 3))
