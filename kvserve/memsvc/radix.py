"""Prefix cache: a radix tree over token ids whose nodes own KV slots.

`PrefixCache` is the contract (match, lock/unlock, insert, evict); `RadixCache` implements
it. With page_size > 1 every key and match length is a whole number of pages, and a
node's children are keyed by their first page.

The tree owns the slots stored in its nodes; a locked node (and all its ancestors) is
never evicted. A `CacheListener` hears of every run of tokens that enters or leaves the
tree (memsvc's KV events). This module knows nothing about requests, rows, leases or the wire.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

_EMPTY = np.empty(0, dtype=np.int64)


class Node:
    """One edge of the tree: `key` token ids, `value` their slots (same length)."""

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access")

    def __init__(self, key: np.ndarray, value: np.ndarray, parent: Node | None, tick: int) -> None:
        self.children: dict[object, Node] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access = tick


@dataclass(frozen=True, slots=True)
class Match:
    """Result of `match_prefix`: the cached slots of the prefix and its last node."""

    slots: np.ndarray
    node: Node


class CacheListener(Protocol):
    """Told of what enters and leaves a `RadixCache`, as whole token sequences from position 0."""

    def stored(self, tokens: np.ndarray, old_len: int) -> None:
        """`tokens` are cached now; before, only its first `old_len` were."""

    def removed(self, tokens: np.ndarray, start: int) -> None:
        """The positions [start, len(tokens)) of the sequence `tokens` left the cache."""


class EvictHook(Protocol):
    """Told, before a leaf's slots are freed, of the whole sequence it ends and its slots."""

    def __call__(self, tokens: np.ndarray, start: int, slots: np.ndarray) -> None:
        """Positions [start, len(tokens)) of `tokens` leave; `slots[i]` holds position i."""


class PrefixCache(ABC):
    """The cache contract memsvc's pool relies on."""

    @abstractmethod
    def match_prefix(self, tokens: np.ndarray, *, count: bool = False) -> Match:
        """Find the longest cached (page-aligned) prefix of `tokens`.

        Args:
            tokens: int64 token ids.
            count: add to the queried / hit token counters (admissions do, commits do not).
        Returns:
            `Match` whose `slots` hold one slot per matched token, `node` the deepest node
            (the root when nothing matched). Does not lock.
        """

    @abstractmethod
    def insert(self, tokens: np.ndarray, slots: np.ndarray) -> int:
        """Insert `tokens` (page-aligned length) with their `slots`.

        Args:
            tokens: int64 token ids; slots: int64 slots of the same length.
        Returns:
            The length of the prefix that was already cached: the caller's slots for those
            positions were NOT taken by the tree and remain the caller's to free.
        """

    @abstractmethod
    def lock(self, node: Node) -> None:
        """Protect `node` and its ancestors from eviction (refcount +1 on each)."""

    @abstractmethod
    def unlock(self, node: Node) -> None:
        """Undo one `lock(node)`."""

    @abstractmethod
    def evict(self, n_slots: int) -> np.ndarray:
        """Drop least-recently-used unlocked leaves until >= n_slots slots are freed.

        Returns:
            The freed slots (possibly fewer than asked when not enough is evictable).
        """

    @property
    @abstractmethod
    def evictable_size(self) -> int:
        """Slots held by unlocked nodes."""

    @property
    @abstractmethod
    def total_size(self) -> int:
        """Slots held by the tree."""


class RadixCache(PrefixCache):
    """Radix tree with LRU eviction of unlocked leaves."""

    def __init__(self, page_size: int = 1, listener: CacheListener | None = None,
                 on_evict: EvictHook | None = None) -> None:
        self.page_size = page_size
        self.listener = listener
        self.on_evict = on_evict
        self._tick = 0
        self.root = Node(_EMPTY, _EMPTY, None, 0)
        self.root.lock_ref = 1
        self._evictable = 0
        self._total = 0
        self.queried_tokens = 0
        self.hit_tokens = 0

    def _child_key(self, key: np.ndarray) -> object:
        return int(key[0]) if self.page_size == 1 else tuple(key[: self.page_size].tolist())

    def _common(self, a: np.ndarray, b: np.ndarray) -> int:
        n = min(len(a), len(b))
        diff = np.flatnonzero(a[:n] != b[:n])
        m = int(diff[0]) if len(diff) else n
        return m - m % self.page_size

    def _split(self, child: Node, n: int) -> Node:
        parent = child.parent
        assert parent is not None
        head = Node(child.key[:n], child.value[:n], parent, child.last_access)
        head.lock_ref = child.lock_ref
        child.key = child.key[n:]
        child.value = child.value[n:]
        child.parent = head
        head.children[self._child_key(child.key)] = child
        parent.children[self._child_key(head.key)] = head
        return head

    def _walk(self, key: np.ndarray) -> tuple[Node, int, list[np.ndarray]]:
        self._tick += 1
        node, pos, parts = self.root, 0, []
        while len(key) - pos >= self.page_size:
            child = node.children.get(self._child_key(key[pos:]))
            if child is None:
                break
            n = self._common(child.key, key[pos:])
            if n == 0:
                break
            partial = n < len(child.key)
            if partial:
                child = self._split(child, n)
            child.last_access = self._tick
            parts.append(child.value)
            node, pos = child, pos + n
            if partial:
                break
        return node, pos, parts

    def _aligned(self, tokens: np.ndarray) -> np.ndarray:
        return tokens[: len(tokens) - len(tokens) % self.page_size]

    def match_prefix(self, tokens: np.ndarray, *, count: bool = False) -> Match:
        tokens = self._aligned(np.asarray(tokens, dtype=np.int64))
        node, pos, parts = self._walk(tokens)
        if count:
            self.queried_tokens += len(tokens)
            self.hit_tokens += pos
        slots = np.concatenate(parts) if parts else _EMPTY
        return Match(slots, node)

    def insert(self, tokens: np.ndarray, slots: np.ndarray) -> int:
        tokens = np.asarray(tokens, dtype=np.int64)
        if len(tokens) % self.page_size or len(tokens) != len(slots):
            raise ValueError("insert needs page-aligned tokens and one slot per token")
        node, pos, _ = self._walk(tokens)
        if pos < len(tokens):
            leaf = Node(tokens[pos:].copy(), np.array(slots[pos:], dtype=np.int64), node, self._tick)
            node.children[self._child_key(leaf.key)] = leaf
            self._evictable += len(leaf.value)
            self._total += len(leaf.value)
            if self.listener is not None:
                self.listener.stored(tokens, pos)
        return pos

    def lock(self, node: Node) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.value)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("unlock of a node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.value)
            node = node.parent  # type: ignore[assignment]

    def evict(self, n_slots: int) -> np.ndarray:
        heap = [(n.last_access, id(n), n) for n in self.nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[np.ndarray] = []
        got = 0
        while got < n_slots and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            if self.listener is not None or self.on_evict is not None:
                path = self.path(leaf)
                if self.listener is not None:
                    self.listener.removed(path, len(path) - len(leaf.key))
                if self.on_evict is not None:
                    self.on_evict(path, len(path) - len(leaf.key), self.path_slots(leaf))
            del parent.children[self._child_key(leaf.key)]
            freed.append(leaf.value)
            got += len(leaf.value)
            self._evictable -= len(leaf.value)
            self._total -= len(leaf.value)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return np.concatenate(freed) if freed else _EMPTY

    @property
    def evictable_size(self) -> int:
        return self._evictable

    @property
    def total_size(self) -> int:
        return self._total

    def _up(self, node: Node, slots: bool) -> np.ndarray:
        parts = []
        while node is not self.root:
            parts.append(node.value if slots else node.key)
            node = node.parent  # type: ignore[assignment]
        return np.concatenate(parts[::-1]) if parts else _EMPTY

    def path(self, node: Node) -> np.ndarray:
        """The token ids from the root to the end of `node`."""
        return self._up(node, slots=False)

    def path_slots(self, node: Node) -> np.ndarray:
        """The slots from the root to the end of `node`."""
        return self._up(node, slots=True)

    def nodes(self) -> Iterator[Node]:
        """Every node but the root (depth first)."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def recount(self) -> None:
        """Recompute the size counters from the nodes (integrity repair)."""
        self._total = self._evictable = 0
        for node in self.nodes():
            self._total += len(node.value)
            if node.lock_ref == 0:
                self._evictable += len(node.value)
