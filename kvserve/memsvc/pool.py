"""Pool state: rows, slot ownership and prefix locks of every lease; the step operations.

Every usable slot is in exactly one place: the allocator's free list, the private part
of one request's row (positions >= its cached_len), a node of the prefix tree, or the
quarantine (the private slots and rows of a lease that expired, kept out of use until a
stalled runner can no longer write them; docs/interfaces.md, "Lease fencing"). Each row
locks the tree node that ends its cached prefix. `check_integrity` verifies this and
repairs what it can.

Each operation validates its item first and raises `ItemError` before changing anything.
This module knows nothing about sockets, the wire or processes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.memsvc.allocator import PageAllocator
from kvserve.memsvc.policy import AdmissionPolicy
from kvserve.memsvc.radix import CacheListener, Match, Node, RadixCache
from kvserve.memsvc.tiers import Tiers
from kvserve.messages.runner_memsvc import (
    REASON_EXHAUSTED,
    REASON_LOADING,
    Admit,
    AdmitResult,
    Commit,
    Grow,
    GrowResult,
    Release,
)


@dataclass(slots=True)
class Quarantined:
    """Slots and rows of an expired lease, reusable from `until` (memsvc's monotonic clock),
    or earlier once `pid` (the lease's local process, 0 when it cannot be watched) has exited
    or attached again."""

    until: float
    slots: np.ndarray
    rows: list[int]
    pid: int = 0


class ItemError(ValueError):
    """A step item that is invalid for this lease; nothing was changed."""


@dataclass(slots=True)
class Row:
    """One admitted request. slots[:cached_len] belong to the tree, the rest to the row."""

    lease: int
    request_id: int
    row: int
    slots: np.ndarray
    cached_len: int
    node: Node
    key: np.ndarray  # the token ids of the cached prefix


def _tokens(ids: list[int], what: str) -> np.ndarray:
    try:
        arr = np.asarray(ids, dtype=np.int64)
    except OverflowError:
        raise ItemError(f"{what}: token id out of range") from None
    if arr.size and int(arr.min()) < 0:
        raise ItemError(f"{what}: negative token id")
    return arr


class Pool:
    """Allocation state of one KV pool; the single writer of `req_to_token`."""

    def __init__(self, *, size: int, page_size: int, max_reqs: int, max_context_len: int,
                 policy: AdmissionPolicy, req_to_token: torch.Tensor,
                 listener: CacheListener | None = None, tiers: Tiers | None = None) -> None:
        self.page_size = page_size
        self.max_context_len = max_context_len
        self.policy = policy
        self.req_to_token = req_to_token
        self.allocator = PageAllocator(size, page_size)
        self.tiers = tiers if tiers is not None and tiers.enabled else None
        if self.tiers is not None and tiers.block_size % page_size:
            raise ValueError(f"the tiers' block size {tiers.block_size} is not a multiple of the page size {page_size}")
        self.tree = RadixCache(page_size, listener, self.tiers.evicted if self.tiers is not None else None)
        self.rows: dict[tuple[int, int], Row] = {}
        self._free_rows = list(range(max_reqs - 1, -1, -1))
        self._request_slots = 0
        self.quarantine: list[Quarantined] = []

    # ---- helpers -------------------------------------------------------------
    def _round(self, n: int) -> int:
        return -(-n // self.page_size) * self.page_size

    def _get(self, lease: int, request_id: int, what: str) -> Row:
        row = self.rows.get((lease, request_id))
        if row is None:
            raise ItemError(f"{what} request_id {request_id}: not held by this lease (never admitted or already released)")
        return row

    def _alloc(self, n: int) -> np.ndarray | None:
        if n <= 0:
            return np.empty(0, dtype=np.int64)
        short = n - self.allocator.free_slots
        if short > 0:
            self.allocator.free(self.tree.evict(short))
            if self.allocator.free_slots < n:
                return None
        return self.allocator.alloc(n)

    def _write_row(self, row: int, start: int, slots: np.ndarray) -> None:
        if len(slots):
            self.req_to_token[row, start:start + len(slots)] = torch.from_numpy(slots)

    # ---- step operations ------------------------------------------------------
    def admit(self, lease: int, item: Admit) -> AdmitResult:
        """Match and lock the prefix, allocate the rest, write the row."""
        what = f"admit request_id {item.request_id}"
        if (lease, item.request_id) in self.rows:
            raise ItemError(f"{what}: request_id already admitted in this lease")
        tokens = _tokens(item.token_ids, what)
        if len(tokens) == 0:
            raise ItemError(f"{what}: empty token_ids")
        if len(tokens) > self.max_context_len:
            raise ItemError(f"{what}: prompt of {len(tokens)} tokens is longer than "
                            f"max_context_len {self.max_context_len}")
        if item.max_new_tokens < 0:
            raise ItemError(f"{what}: max_new_tokens {item.max_new_tokens} is negative")
        if not self._free_rows:
            return AdmitResult(item.request_id, False, reason=REASON_EXHAUSTED)
        cap = self.policy.admit_capacity(len(tokens), item.max_new_tokens)
        cap = self._round(min(max(cap, len(tokens)), self.max_context_len))
        match = self.tree.match_prefix(tokens[:-1], count=True)
        self.tree.lock(match.node)
        if self.tiers is not None:
            if self.allocator.free_slots + self.tree.evictable_size < cap - len(match.slots):
                # the row cannot be had now: copying its blocks in would only be evicted again
                self.tree.unlock(match.node)
                return AdmitResult(item.request_id, False, reason=REASON_EXHAUSTED)
            promoted = self._promote(tokens[:-1], match)
            if promoted is None:
                self.tree.unlock(match.node)
                return AdmitResult(item.request_id, False, reason=REASON_LOADING)
            match = promoted
        cached = len(match.slots)
        fresh = self._alloc(cap - cached)
        if fresh is None:
            self.tree.unlock(match.node)
            return AdmitResult(item.request_id, False, reason=REASON_EXHAUSTED)
        row_id = self._free_rows.pop()
        slots = np.concatenate([match.slots, fresh])
        self._write_row(row_id, 0, slots)
        self.rows[(lease, item.request_id)] = Row(lease, item.request_id, row_id, slots, cached, match.node,
                                           tokens[:cached].copy())
        self._request_slots += len(fresh)
        return AdmitResult(item.request_id, True, row=row_id, cached_len=cached, capacity=cap)

    def _promote(self, tokens: np.ndarray, match: Match) -> Match | None:
        """Extend the locked `match` with the blocks the lower tiers hold (copied into fresh
        slots and inserted into the tree); the new locked match, or None while blocks are
        still being read from disk (nothing changed then)."""
        assert self.tiers is not None
        cached = len(match.slots)
        found = self.tiers.lookup(tokens, cached)
        if found.loading:
            return None
        end = (found.first + len(found.blocks)) * self.tiers.block_size
        if end <= cached:
            return match
        fresh = self._alloc(end - cached)
        if fresh is None:  # the pool is full: serve the request with what it has
            return match
        self.tiers.fill(found, cached, fresh)
        self.tree.insert(tokens[:end], np.concatenate([match.slots, fresh]))
        promoted = self.tree.match_prefix(tokens[:end])
        self.tree.lock(promoted.node)
        self.tree.unlock(match.node)
        return promoted

    def grow(self, lease: int, item: Grow) -> GrowResult:
        """Make the row hold at least item.capacity slots."""
        row = self._get(lease, item.request_id, "grow")
        if item.capacity > self.max_context_len:
            raise ItemError(f"grow request_id {item.request_id}: capacity {item.capacity} exceeds "
                            f"max_context_len {self.max_context_len}")
        have = len(row.slots)
        if item.capacity <= have:
            return GrowResult(item.request_id, True, capacity=have)
        fresh = self._alloc(self._round(item.capacity) - have)
        if fresh is None:
            return GrowResult(item.request_id, False, capacity=have, reason=REASON_EXHAUSTED)
        self._write_row(row.row, have, fresh)
        row.slots = np.concatenate([row.slots, fresh])
        self._request_slots += len(fresh)
        return GrowResult(item.request_id, True, capacity=len(row.slots))

    def _check_commit(self, row: Row, tokens: np.ndarray, what: str) -> None:
        if len(tokens) > len(row.slots):
            raise ItemError(f"{what}: {len(tokens)} tokens exceed the row's capacity {len(row.slots)}")
        k = min(len(tokens), row.cached_len)
        if not np.array_equal(tokens[:k], row.key[:k]):
            raise ItemError(f"{what}: token_ids differ from the request's cached prefix")

    def _commit(self, row: Row, tokens: np.ndarray) -> None:
        n = len(tokens) - len(tokens) % self.page_size
        if n <= row.cached_len:
            return
        present = self.tree.insert(tokens[:n], row.slots[:n])
        if present > row.cached_len:
            # another request cached these tokens first: use its slots, free ours
            self.allocator.free(row.slots[row.cached_len:present])
        match = self.tree.match_prefix(tokens[:n])
        if self.tiers is not None and present < n:
            self.tiers.stored(tokens[:n], present, match.slots)
        self.tree.lock(match.node)
        self.tree.unlock(row.node)
        self._request_slots -= n - row.cached_len
        row.slots[:n] = match.slots
        self._write_row(row.row, row.cached_len, match.slots[row.cached_len:])
        row.cached_len, row.node, row.key = n, match.node, tokens[:n].copy()

    def commit(self, lease: int, item: Commit) -> None:
        """Insert the computed KV of positions [0, len(token_ids)) into the prefix cache."""
        what = f"commit request_id {item.request_id}"
        row = self._get(lease, item.request_id, "commit")
        tokens = _tokens(item.token_ids, what)
        self._check_commit(row, tokens, what)
        self._commit(row, tokens)

    def release(self, lease: int, item: Release) -> None:
        """Optional final commit, then unlock and free the row and its private slots."""
        what = f"release request_id {item.request_id}"
        row = self._get(lease, item.request_id, "release")
        if item.token_ids is not None:
            tokens = _tokens(item.token_ids, what)
            self._check_commit(row, tokens, what)
            self._commit(row, tokens)
        self._drop(row)

    def _drop(self, row: Row, into: Quarantined | None = None) -> None:
        self.tree.unlock(row.node)
        private = row.slots[row.cached_len:]
        self._request_slots -= len(private)
        del self.rows[(row.lease, row.request_id)]
        if into is None:
            self.allocator.free(private)
            self._free_rows.append(row.row)
        else:
            into.slots = np.concatenate([into.slots, private])
            into.rows.append(row.row)

    def drop_lease(self, lease: int, *, quarantine_until: float | None = None, pid: int = 0) -> int:
        """Free every row of `lease` without committing anything; returns the row count.

        With `quarantine_until`, the rows and their private slots are not reusable before
        that time, or before `pid` (when not 0) exits or attaches again (`release_quarantine`):
        the lease expired, and its runner may be stalled in the middle of a step."""
        mine = [r for r in self.rows.values() if r.lease == lease]
        held = None
        if quarantine_until is not None and mine:
            held = Quarantined(quarantine_until, np.empty(0, dtype=np.int64), [], pid)
            self.quarantine.append(held)
        for row in mine:
            self._drop(row, held)
        return len(mine)

    def release_quarantine(self, now: float, done: Callable[[int], bool] | None = None) -> int:
        """Return the quarantined slots and rows whose time has come, or whose process
        `done(pid)` says can write no more; returns the slot count."""
        due = [q for q in self.quarantine if q.until <= now or (q.pid and done is not None and done(q.pid))]
        if not due:
            return 0
        self.quarantine = [q for q in self.quarantine if not any(q is d for d in due)]
        for q in due:
            self.allocator.free(q.slots)
            self._free_rows.extend(q.rows)
        return sum(len(q.slots) for q in due)

    @property
    def quarantined_slots(self) -> int:
        return sum(len(q.slots) for q in self.quarantine)

    def evict(self, n_slots: int) -> int:
        """Evict up to n_slots unlocked cached slots back to the free list; returns the count."""
        freed = self.tree.evict(n_slots)
        self.allocator.free(freed)
        return len(freed)

    def recount(self) -> None:
        """Recompute the request-slot counter from the rows (integrity repair)."""
        self._request_slots = sum(len(r.slots) - r.cached_len for r in self.rows.values())

    # ---- accounting -----------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return self.allocator.free_slots

    @property
    def request_slots(self) -> int:
        return self._request_slots

    @property
    def cached_slots(self) -> int:
        return self.tree.total_size

    def kv_usage(self) -> float:
        """Fraction of usable slots that cannot be handed out now (evictable cache excluded)."""
        usable = self.allocator.usable_slots
        busy = usable - self.allocator.free_slots - self.tree.evictable_size
        return max(0.0, min(1.0, busy / usable))
