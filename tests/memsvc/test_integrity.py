"""check_integrity finds and repairs corrupted pool state."""

from __future__ import annotations

import numpy as np
import torch

from kvserve.memsvc.integrity import check_integrity
from kvserve.memsvc.policy import make_policy
from kvserve.memsvc.pool import Pool
from kvserve.messages.runner_memsvc import Admit, Release


def make_pool() -> Pool:
    pool = Pool(size=32, page_size=1, max_reqs=4, max_context_len=16,
                policy=make_policy("reserve", 4), req_to_token=torch.zeros(4, 16, dtype=torch.int32))
    pool.admit(1, Admit(0, [1, 2, 3, 4], 2))
    pool.release(1, Release(0, [1, 2, 3, 4]))
    pool.admit(1, Admit(1, [1, 2, 3, 4, 5], 2))
    assert check_integrity(pool) == []
    return pool


def test_double_free_is_found_and_repaired() -> None:
    pool = make_pool()
    row = pool.rows[(1, 1)]
    pool.allocator.free(row.slots[-2:])  # a bug: private slots also on the free list
    problems = check_integrity(pool)
    assert any("more than once" in p for p in problems)
    assert check_integrity(pool) == []
    assert pool.free_slots + pool.request_slots + pool.cached_slots == 31


def test_leaked_slots_and_bad_locks_and_scribbled_row() -> None:
    pool = make_pool()
    pool.allocator.alloc(3)  # leaked: held by nobody
    node = pool.rows[(1, 1)].node
    node.lock_ref += 2
    pool.req_to_token[pool.rows[(1, 1)].row, 0] = 0
    problems = check_integrity(pool)
    assert len(problems) == 3, problems
    assert check_integrity(pool) == []
    assert node.lock_ref == 1
    assert pool.free_slots == 31 - pool.request_slots - pool.cached_slots
    assert np.array_equal(pool.req_to_token[pool.rows[(1, 1)].row, :3].numpy(), pool.rows[(1, 1)].slots[:3])
