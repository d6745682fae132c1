"""`check_integrity`: verify a `Pool`'s invariants and repair what drifted.

Invariants: every usable slot is held exactly once (free list, a row's private part, a
tree node, or the quarantine of an expired lease); the reserved page 0 is held by nobody; every node's lock count equals the
number of rows whose locked node lies at or below it; each row of `req_to_token` matches
the row's slots. Repairs: lock counts are recomputed, the free list is rebuilt from the
slots nobody holds, a damaged table row is rewritten. Slots held twice by rows/tree cannot
be repaired safely and are only reported.

This module knows nothing about sockets or leases.
"""

from __future__ import annotations

import numpy as np
import torch

from kvserve.memsvc.pool import Pool


def check_integrity(pool: Pool, *, repair: bool = True) -> list[str]:
    """Return one message per violation found (empty when all holds), repairing if asked."""
    problems: list[str] = []
    alloc, tree, ps = pool.allocator, pool.tree, pool.page_size
    size = alloc.size
    held_parts = [r.slots[r.cached_len:] for r in pool.rows.values()]
    held_parts += [n.value for n in tree.nodes()]
    held_parts += [q.slots for q in pool.quarantine]
    held = np.bincount(np.concatenate(held_parts), minlength=size) if held_parts else np.zeros(size, np.int64)
    free_pages = alloc.free_page_ids()
    free_count = np.bincount(free_pages, minlength=alloc.n_pages)
    free = np.repeat(free_count, ps)[:size]
    total = held + free
    if total[:ps].any():
        problems.append(f"reserved page 0 is held ({int(total[:ps].sum())} claims)")
    usable = total[ps:]
    lost = int(np.count_nonzero(usable == 0))
    multi = int(np.count_nonzero(usable > 1))
    if lost:
        problems.append(f"{lost} slots are neither free nor held")
    if multi:
        problems.append(f"{multi} slots are claimed more than once")
    if int(np.count_nonzero(held[ps:] > 1)):
        problems.append("some slots are held by two owners (not repairable)")

    expected: dict[int, int] = {}
    for r in pool.rows.values():
        node = r.node
        while node is not tree.root:
            expected[id(node)] = expected.get(id(node), 0) + 1
            node = node.parent
    bad_locks = [n for n in tree.nodes() if n.lock_ref != expected.get(id(n), 0)]
    if bad_locks:
        problems.append(f"{len(bad_locks)} tree nodes have a wrong lock count")

    bad_rows = []
    for r in pool.rows.values():
        table = pool.req_to_token[r.row, : len(r.slots)].cpu().numpy()
        if not np.array_equal(table, r.slots):
            bad_rows.append(r)
    if bad_rows:
        problems.append(f"{len(bad_rows)} req_to_token rows differ from their slots")

    if problems and repair:
        for n in bad_locks:
            n.lock_ref = expected.get(id(n), 0)
        tree.recount()
        if lost or multi:
            held_pages = np.add.reduceat(held, np.arange(0, size, ps)) if ps > 1 else held
            alloc.set_free_pages(np.flatnonzero(held_pages[1:] == 0)[::-1] + 1)
        for r in bad_rows:
            pool.req_to_token[r.row, : len(r.slots)] = torch.from_numpy(r.slots)
        pool.recount()
    return problems
