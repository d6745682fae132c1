"""memsvc's KV-cache events for routers: which blocks of tokens this node holds.

`BlockEvents` listens to the radix cache and turns what enters and leaves it into vLLM-format
events over aligned blocks of `block_size` tokens from position 0: `BlockStored` when a block
becomes complete in the cache, `BlockRemoved` when any of its tokens is evicted,
`AllBlocksCleared` first (memsvc starts empty). The tiers below the pool tell it of their
blocks too (`tier_stored`, `tier_removed`: medium "CPU" for host memory, "DISK"). A block's
hash is SHA-256 over the token ids (uint32 little-endian) of the whole sequence up to the
block's end: the same content hashes
the same on every node, a block's parent is the hash of the sequence one block shorter, and
no two different prefixes share a hash.

`EventPublisher` owns the two sockets a router connects to: a PUB for live messages
(`[topic, seq, payload]`, seq from 0 for memsvc's life, +1 per message) and a ROUTER that
replays buffered messages from a requested seq, then an end marker. It never blocks: PUB
drops above its high-water mark (the router sees a gap and asks for a replay), and the ring
of recent messages is bounded.

Knows ZMQ, numpy and the event format; nothing about requests, leases or the pool.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import time
from collections import deque

import numpy as np
import zmq

from kvserve.config.curve import ServerKeys, secure_server
from kvserve.messages.kv_events import (
    MAX_EVENTS_PER_BATCH,
    REPLAY_END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    encode_batch,
    encode_seq,
)
from kvserve.paths import bind_private

log = logging.getLogger("kvserve.memsvc")

REPLAY_RING = 4096
"""Messages kept for replays (a router that fell further behind starts over from live)."""
PUB_HWM = 100_000
_END = [b"", encode_seq(REPLAY_END_SEQ), b""]  # the replay's end marker: empty topic and payload
_START = struct.Struct(">Q")


class BlockEvents:
    """A `radix.CacheListener` that queues KV events; `take()` hands them over.

    The listener calls only copy the changed tokens; hashing and building the events wait
    for `take()`, which memsvc calls after it has answered the frames at hand, so that no
    reply waits on them."""

    def __init__(self, block_size: int) -> None:
        """`block_size` must be a multiple of the cache's page size: the cache matches whole pages,
        so a block inside a page could be cached on two paths and announced twice."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._cleared = True  # memsvc starts empty: AllBlocksCleared comes first
        # (stored?, ids up to the last block, first) of the pool, or a built event of a lower tier
        self._pending: list[tuple[bool, np.ndarray, int] | BlockStored | BlockRemoved] = []
        self.stored_blocks = 0
        self.removed_blocks = 0

    def _hashes(self, ids: np.ndarray, first: int, last: int) -> tuple[bytes | None, list[bytes]]:
        """(hash of block first-1 or None, hashes of blocks first..last-1) of the sequence `ids`."""
        b = self.block_size
        h = hashlib.sha256(ids[: first * b].tobytes())
        parent = h.digest() if first else None
        out = []
        for i in range(first, last):
            h.update(ids[i * b:(i + 1) * b].tobytes())
            out.append(h.digest())
        return parent, out

    def _queue(self, stored: bool, tokens: np.ndarray, start: int) -> None:
        b = self.block_size
        first, last = start // b, len(tokens) // b  # only complete blocks are announced
        if last > first:
            self._pending.append((stored, np.array(tokens[: last * b], dtype="<u4"), first))

    def stored(self, tokens: np.ndarray, old_len: int) -> None:
        self._queue(True, tokens, old_len)

    def removed(self, tokens: np.ndarray, start: int) -> None:
        self._queue(False, tokens, start)

    # ---- the tiers below the pool (kvserve.memsvc.tiers.blocks.TierListener) ----------------------
    def chain(self, tokens: np.ndarray, first: int, last: int) -> tuple[bytes | None, list[bytes]]:
        """(hash of block first-1 or None, hashes of blocks first..last-1) of `tokens`."""
        return self._hashes(np.array(tokens[: last * self.block_size], dtype="<u4"), first, last)

    def tier_stored(self, medium: str, parent: bytes | None, hashes: list[bytes], token_ids: np.ndarray) -> None:
        self._pending.append(BlockStored(block_hashes=hashes, parent_block_hash=parent,
                                         token_ids=[int(t) for t in token_ids], block_size=self.block_size,
                                         medium=medium))

    def tier_removed(self, medium: str, hashes: list[bytes]) -> None:
        self._pending.append(BlockRemoved(block_hashes=hashes, medium=medium))

    @property
    def pending(self) -> bool:
        """Whether `take()` has events to give."""
        return self._cleared or bool(self._pending)

    def take(self) -> list[KVEvent]:
        """The events queued since the last call, oldest first."""
        out: list[KVEvent] = [AllBlocksCleared()] if self._cleared else []
        self._cleared = False
        pending, self._pending = self._pending, []
        b = self.block_size
        for item in pending:
            if isinstance(item, BlockStored | BlockRemoved):
                out.append(item)
                if isinstance(item, BlockStored):
                    self.stored_blocks += len(item.block_hashes)
                else:
                    self.removed_blocks += len(item.block_hashes)
                continue
            stored, ids, first = item
            parent, hashes = self._hashes(ids, first, len(ids) // b)
            if stored:
                out.append(BlockStored(block_hashes=hashes, parent_block_hash=parent,
                                       token_ids=ids[first * b:].tolist(), block_size=b))
                self.stored_blocks += len(hashes)
            else:
                out.append(BlockRemoved(block_hashes=hashes))
                self.removed_blocks += len(hashes)
        return out


class EventPublisher:
    """The PUB socket for live event messages and the ROUTER that replays them."""

    def __init__(self, ctx: zmq.Context, endpoint: str, replay_endpoint: str, *, topic: bytes = b"",
                 ring: int = REPLAY_RING, curve: ServerKeys | None = None) -> None:
        """`curve`: both sockets are CURVE servers under the context's ZAP handler (memsvc's,
        started by `apply_server` under the name "memsvc")."""
        self.topic = topic
        self.seq = 0
        self.sent = 0
        self.dropped = 0
        self.bad_replays = 0  # malformed replay requests
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=ring)
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, PUB_HWM)
        self.replay = ctx.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay.setsockopt(zmq.MAXMSGSIZE, 1024)  # a replay request is 8 bytes (CURVE handshakes more)
        if curve is not None:
            for sock in (self.pub, self.replay):
                secure_server(sock, curve, name="memsvc")
        try:
            bind_private(self.pub, endpoint)
            bind_private(self.replay, replay_endpoint)
        except zmq.ZMQError:
            self.close()
            raise

    def publish(self, events: list[KVEvent]) -> None:
        """Send `events` in messages of at most MAX_EVENTS_PER_BATCH; never blocks."""
        for i in range(0, len(events), MAX_EVENTS_PER_BATCH):
            payload = encode_batch(time.time(), events[i:i + MAX_EVENTS_PER_BATCH])
            self._ring.append((self.seq, payload))
            try:
                self.pub.send_multipart([self.topic, encode_seq(self.seq), payload], zmq.NOBLOCK)
                self.sent += 1
            except zmq.Again:  # above the high-water mark: the router sees a gap and replays
                self.dropped += 1
            self.seq += 1

    def serve_replays(self) -> None:
        """Answer every pending replay request: `[id, "", start]` -> the buffered messages from
        seq `start` on, then the end marker. A malformed request is counted and dropped."""
        while True:
            try:
                parts = self.replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(parts) != 3 or parts[1] != b"" or len(parts[2]) != _START.size:
                self.bad_replays += 1
                continue
            ident, (start,) = parts[0], _START.unpack(parts[2])
            try:
                for seq, payload in self._ring:
                    if seq >= start:
                        self.replay.send_multipart([ident, b"", self.topic, encode_seq(seq), payload],
                                                   zmq.NOBLOCK)
                self.replay.send_multipart([ident, b"", *_END], zmq.NOBLOCK)
            except zmq.Again:  # the requester stopped reading: it will ask again
                pass

    def close(self) -> None:
        self.pub.close(0)
        self.replay.close(0)
