"""`Tiers`: the host and disk tiers of one pool, written on store and eviction, read on
admission (`lookup` answers "loading" while a prefix's next blocks are read from disk).

Knows the pool's buffers, the tiers and the listener; nothing about leases or the wire."""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvserve.memsvc.tiers.blocks import (
    Block,
    BlockShape,
    TierListener,
    TierStats,
    block_keys,
    identity_digest,
)
from kvserve.memsvc.tiers.disk import DiskTier
from kvserve.memsvc.tiers.host import HostTier
from kvserve.memsvc.tiers.worker import DiskWorker

MAX_STAGED_BYTES = 1 << 30
"""Blocks read from disk and waiting for their request's next admission (oldest dropped)."""


@dataclass(frozen=True, slots=True)
class TierSettings:
    """The tiers memsvc was asked for (`--host-cache-bytes`, `--disk-cache-dir`,
    `--disk-cache-bytes`), the model's fingerprint and the block size."""

    host_bytes: int
    disk_dir: str
    disk_bytes: int
    model: bytes
    block_size: int

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0 or bool(self.disk_dir)


@dataclass(slots=True)
class Found:
    """What the tiers hold of a prefix past what the pool matched: `blocks` (in host memory,
    in order, the first starting at block `first`) and whether more are being read."""

    first: int
    blocks: list[Block]
    keys: list[bytes]
    loading: bool


class Tiers:
    """The host and disk tiers of one pool: written on store and eviction, read on admission.

    `k_buffer` / `v_buffer` are the pool's ([n_layers, slots, n_kv_heads, head_dim])."""

    @classmethod
    def create(cls, k_buffer: torch.Tensor, v_buffer: torch.Tensor, settings: TierSettings) -> Tiers:
        """The tiers of the pool whose buffers these are."""
        n_layers, _, n_kv_heads, head_dim = k_buffer.shape
        shape = BlockShape(n_layers, n_kv_heads, head_dim, str(k_buffer.dtype).removeprefix("torch."),
                           settings.block_size)
        return cls(k_buffer, v_buffer, shape, identity=identity_digest(settings.model, shape),
                   host_bytes=settings.host_bytes, disk_dir=settings.disk_dir, disk_bytes=settings.disk_bytes)

    def __init__(self, k_buffer: torch.Tensor, v_buffer: torch.Tensor, shape: BlockShape, *,
                 identity: bytes, host_bytes: int, disk_dir: str = "", disk_bytes: int = 0) -> None:
        self.k_buffer, self.v_buffer, self.shape, self.identity = k_buffer, v_buffer, shape, identity
        self.block_size = shape.block_size
        self.stats = TierStats()
        self.host = HostTier(host_bytes) if host_bytes > 0 else None
        self.disk = DiskTier(Path(disk_dir), disk_bytes, identity, shape, self.stats) if disk_dir else None
        self.worker = DiskWorker(self.disk, self.stats) if self.disk is not None else None
        self.staged: OrderedDict[bytes, Block] = OrderedDict()  # read from disk, for the next admission
        self._staged_bytes = 0
        self._pin = k_buffer.device.type == "cuda" and torch.cuda.is_available()
        self.listener: TierListener | None = None  # the KV events ("CPU", "DISK" blocks): `tell`

    @property
    def enabled(self) -> bool:
        return self.host is not None or self.disk is not None

    def _copy_out(self, slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `slots` (a multiple of block_size of them) in host memory, in one gather."""
        idx = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)).to(self.k_buffer.device)
        k, v = self.k_buffer[:, idx], self.v_buffer[:, idx]
        if self.k_buffer.device.type != "cpu":
            k, v = k.to("cpu", non_blocking=False), v.to("cpu", non_blocking=False)
            if self._pin:
                k, v = k.pin_memory(), v.pin_memory()
        return k, v

    def _blocks(self, tokens: np.ndarray, start: int, slots: np.ndarray,
                want: Callable[[bytes], bool]) -> list[tuple[int, bytes, Block]]:
        """(index, key, block) of the whole blocks of `tokens` that end past `start` and that
        `want` (copied out of the pool; `slots` are the tokens' slots from position 0)."""
        b = self.block_size
        first, last = start // b, len(tokens) // b
        if last <= first:
            return []
        keys = block_keys(self.identity, tokens, b, last)[first:]
        chosen = [(first + i, key) for i, key in enumerate(keys) if want(key)]
        if not chosen:
            return []
        idx = np.concatenate([slots[i * b:(i + 1) * b] for i, _ in chosen])
        k, v = self._copy_out(idx)
        out = [(i, key, Block(k[:, j * b:(j + 1) * b].clone(), v[:, j * b:(j + 1) * b].clone()))
               for j, (i, key) in enumerate(chosen)]
        if self.listener is not None:  # the blocks' KV-event hashes, for the tiers' events
            parent, hashes = self.listener.chain(tokens, first, last)
            for i, _, block in out:
                block.event = hashes[i - first]
                block.parent = hashes[i - first - 1] if i > first else parent
        return out

    def stored(self, tokens: np.ndarray, start: int, slots: np.ndarray) -> None:
        """`tokens` (with `slots` from position 0) entered the pool from position `start`:
        write their new whole blocks through to disk."""
        if self.worker is None or not self.disk.writable:
            return
        worker, disk = self.worker, self.disk
        t0 = time.perf_counter()
        for i, key, block in self._blocks(tokens, start, slots,
                                           lambda k: k not in disk and k not in worker.queued):
            worker.write(key, i, tokens[i * self.block_size:(i + 1) * self.block_size].copy(), block)
        self.stats.seconds["disk"] += time.perf_counter() - t0

    def evicted(self, tokens: np.ndarray, start: int, slots: np.ndarray) -> None:
        """Positions [start, len(tokens)) of `tokens` leave the pool: keep their whole blocks
        in the host tier (the disk has them already)."""
        if self.host is None:
            return
        host, b, ev = self.host, self.block_size, self.listener
        t0 = time.perf_counter()
        for i, key, block in self._blocks(tokens, start, slots, lambda k: k not in host):
            dropped = host.put(key, block)
            if dropped is None:
                continue
            self.stats.bytes_in["host"] += block.nbytes
            if ev is not None and block.event is not None:
                ev.tier_stored("CPU", block.parent, [block.event], tokens[i * b:(i + 1) * b])
                gone = [d.event for d in dropped if d.event is not None]
                if gone:
                    ev.tier_removed("CPU", gone)
        self.stats.seconds["host"] += time.perf_counter() - t0

    def tell(self, listener: TierListener | None) -> None:
        """Send the tiers' blocks to `listener` from now on (the disk's blocks from before too)."""
        self.listener = listener
        if listener is not None and self.worker is not None:
            self.worker.announce()

    def poll_events(self) -> None:
        """Tell the listener of the blocks the disk worker wrote (or found from before) and
        deleted since the last call."""
        if self.listener is None or self.worker is None or self.disk is None:
            return
        w = self.worker
        with w._cv:
            stored, w.stored = list(w.stored), deque()
        for event, parent, tokens in stored:
            self.listener.tier_stored("DISK", parent, [event], tokens)
        removed = self.disk.take_removed()
        if removed:
            self.listener.tier_removed("DISK", removed)

    def _take_reads(self) -> None:
        """Stage the blocks the worker has read since the last call."""
        if self.worker is None:
            return
        w = self.worker
        with w._cv:
            done, w.done = list(w.done), deque()
            for key, _ in done:
                w.reading.discard(key)
        for key, block in done:
            if block is None or key in self.staged:
                continue
            self.staged[key] = block
            self._staged_bytes += block.nbytes
        while self._staged_bytes > MAX_STAGED_BYTES and self.staged:
            _, old = self.staged.popitem(last=False)
            self._staged_bytes -= old.nbytes

    def lookup(self, tokens: np.ndarray, cached: int) -> Found:
        """The blocks of `tokens` past the pool's `cached` tokens that the tiers hold, in
        order, up to the first one they lack; `loading` when the next ones are on disk only
        (their reads are started: ask again)."""
        b = self.block_size
        first, last = cached // b, len(tokens) // b
        found = Found(first, [], [], False)
        if last <= first or not self.enabled:
            return found
        self._take_reads()
        keys = block_keys(self.identity, tokens, b, last)[first:]
        missing: list[bytes] = []
        for key in keys:
            block = self.host.get(key) if self.host is not None else None
            if block is None:
                block = self.staged.get(key)
            if block is not None and not missing:
                found.blocks.append(block)
                found.keys.append(key)
                continue
            if self.disk is not None and key in self.disk:
                missing.append(key)
                continue
            break
        if missing:
            assert self.worker is not None
            self.worker.read(missing)
            found.loading = True
        return found

    def fill(self, found: Found, cached: int, slots: np.ndarray) -> None:
        """Copy `found`'s blocks into the pool: positions [cached, end of the blocks) into
        `slots` (one per position)."""
        b = self.block_size
        skip = cached - found.first * b  # positions of the first block the pool has already
        k = torch.cat([blk.k for blk in found.blocks], dim=1)[:, skip:]
        v = torch.cat([blk.v for blk in found.blocks], dim=1)[:, skip:]
        idx = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)).to(self.k_buffer.device)
        dev = self.k_buffer.device
        self.k_buffer[:, idx] = k.to(dev, non_blocking=self._pin)
        self.v_buffer[:, idx] = v.to(dev, non_blocking=self._pin)
        for i, (key, blk) in enumerate(zip(found.keys, found.blocks, strict=True)):
            if key in self.staged:  # read from disk for this admission
                self._staged_bytes -= self.staged.pop(key).nbytes
                tier = "disk"
            else:
                tier = "host"
                self.stats.bytes_out["host"] += blk.nbytes
            self.stats.hits[tier] += b - (skip if i == 0 else 0)

    def flush(self, timeout: float = 10.0) -> bool:
        return self.worker.flush(timeout) if self.worker is not None else True

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.disk is not None:
            self.disk.close()
