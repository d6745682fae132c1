"""The disk tier's worker thread: reads first, writes after, so the memsvc loop never
waits on the disk; it reports finished reads and newly stored blocks through queues the
loop drains.

Knows the disk tier; nothing about the pool, the host tier or requests."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import numpy as np

from kvserve.memsvc.tiers.blocks import Block, TierStats
from kvserve.memsvc.tiers.disk import DiskTier

log = logging.getLogger("kvserve.memsvc")

MAX_QUEUED_WRITES = 4096
"""Blocks waiting for the disk writer; above it new writes are dropped (and counted)."""


class DiskWorker:
    """The thread that does the disk tier's reads (first) and writes (after). It starts by
    reading the headers of the files a previous memsvc left, to announce them (`stored`)."""

    def __init__(self, disk: DiskTier, stats: TierStats) -> None:
        self.disk, self.stats = disk, stats
        self._cv = threading.Condition()
        self._writes: deque[tuple[bytes, int, np.ndarray, Block]] = deque()
        self._reads: deque[bytes] = deque()
        self.reading: set[bytes] = set()  # asked for and not yet staged
        self.queued: set[bytes] = set()  # writes waiting
        self.done: deque[tuple[bytes, Block | None]] = deque()  # reads finished, for the loop
        # blocks on disk now, for the loop's events: (event hash, parent's, token ids)
        self.stored: deque[tuple[bytes, bytes | None, np.ndarray]] = deque()
        self._announce = False  # `announce()` asks for it (when KV events are published)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kv-disk-tier", daemon=True)
        self._thread.start()

    def write(self, key: bytes, index: int, tokens: np.ndarray, block: Block) -> None:
        with self._cv:
            if key in self.queued:
                return
            if len(self._writes) >= MAX_QUEUED_WRITES:
                self.stats.error("queue_full")
                return
            self._writes.append((key, index, tokens, block))
            self.queued.add(key)
            self._cv.notify()

    def read(self, keys: list[bytes]) -> None:
        with self._cv:
            for key in keys:
                if key not in self.reading:
                    self.reading.add(key)
                    self._reads.append(key)
            self._cv.notify()

    def announce(self) -> None:
        """Read the headers of the files a previous memsvc left, to announce them (`stored`)."""
        with self._cv:
            self._announce = True
            self._cv.notify()

    def _announce_old(self) -> None:
        try:
            for _, event, parent, tokens in self.disk.unannounced():
                with self._cv:
                    self.stored.append((event, parent, tokens))
        except Exception:  # noqa: BLE001 - the thread must outlive any file it meets
            log.exception("memsvc: disk tier: announcing the blocks from before")

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._stop or self._reads or self._writes or self._announce):
                    self._cv.wait()
                announce, self._announce = self._announce, False
            if announce:
                self._announce_old()
                continue
            with self._cv:
                if self._stop and not self._writes and not self._reads:
                    return
                read = self._reads.popleft() if self._reads else None
                job = self._writes.popleft() if read is None else None
            t0 = time.perf_counter()
            try:
                self._do(read, job)
            except Exception:  # noqa: BLE001 - the thread must outlive any file it meets
                log.exception("memsvc: disk tier worker")
                self.stats.error("internal")
                with self._cv:
                    if read is not None:
                        self.done.append((read, None))
                    if job is not None:
                        self.queued.discard(job[0])
            self.stats.seconds["disk"] += time.perf_counter() - t0

    def _do(self, read: bytes | None, job: tuple[bytes, int, np.ndarray, Block] | None) -> None:
        if read is not None:
            block = self.disk.read(read)
            with self._cv:
                self.done.append((read, block))
            if block is not None:
                self.stats.bytes_out["disk"] += block.nbytes
            return
        assert job is not None
        key, index, tokens, block = job
        if self.disk.write(key, index, tokens, block):
            self.stats.bytes_in["disk"] += block.nbytes
            with self._cv:
                if block.event is not None:
                    self.stored.append((block.event, block.parent, tokens))
        with self._cv:
            self.queued.discard(key)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued write is on disk (tests, clean stop)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._cv:
                if not self._writes and not self.queued:
                    return True
            time.sleep(0.005)
        return False

    def close(self, timeout: float = 10.0) -> None:
        """Finish the queued writes (a clean stop keeps what was cached), then stop."""
        with self._cv:
            self._reads.clear()
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout)
