"""The disk tier: one checksummed file per block under `<dir>/<identity>/`, written
atomically (temporary name, sync, rename), least recently used deleted first, indexed again
by the next memsvc (a warm restart); a file whose size, header or checksum does not hold is
deleted and counted, never served.

Knows files and the block format (`blocks`); nothing about threads, the pool or requests."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from kvserve.memsvc.tiers.blocks import (
    DTYPE_CODES,
    FORMAT_VERSION,
    HEADER,
    MAGIC,
    NO_HASH,
    SUFFIX,
    Block,
    BlockShape,
    TierError,
    TierStats,
)

log = logging.getLogger("kvserve.memsvc")

class DiskTier:
    """One file per block under `directory/<identity>/`, LRU, at most `capacity` bytes.

    Thread-safe: the worker thread writes and reads, the memsvc loop asks what is there."""

    def __init__(self, directory: Path, capacity: int, identity: bytes, shape: BlockShape,
                 stats: TierStats) -> None:
        self.shape, self.identity, self.capacity, self.stats = shape, identity, capacity, stats
        self.root = Path(directory)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise TierError(f"--disk-cache-dir {directory}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise TierError(f"--disk-cache-dir {directory}: another memsvc uses this directory "
                            "(one memsvc per directory)") from None
        self.dir = self.root / identity.hex()[:32]
        self._mutex = threading.Lock()
        # key -> the block's KV-event hash (None until announced: files of a previous memsvc), LRU first
        self.index: OrderedDict[bytes, bytes | None] = OrderedDict()
        self.removed: list[bytes] = []  # event hashes of deleted files, for the loop's events
        self.writable = True
        try:
            self.dir.mkdir(exist_ok=True)
        except OSError as exc:
            self._failed("mkdir", exc)
        self._scan()

    @property
    def bytes(self) -> int:
        return len(self.index) * self.shape.file_bytes

    def _path(self, key: bytes) -> Path:
        return self.dir / (key.hex() + SUFFIX)

    def _failed(self, what: str, exc: OSError) -> None:
        self.stats.error(what)
        log.warning("memsvc: disk tier %s: %s failed: %s", self.dir, what, exc)

    def _scan(self) -> None:
        """Index the files a previous memsvc left: well-named and of the right size (a torn
        file is deleted here, a corrupted one when it is read)."""
        if not self.dir.is_dir():
            return
        found = []
        for entry in os.scandir(self.dir):
            name = entry.name
            if not name.endswith(SUFFIX):  # a temporary file a killed writer left
                self._unlink(Path(entry.path), "torn")
                continue
            try:
                key = bytes.fromhex(name[: -len(SUFFIX)])
                st = entry.stat()
            except (ValueError, OSError):
                self._unlink(Path(entry.path), "corrupt")
                continue
            if len(key) != 32 or st.st_size != self.shape.file_bytes:
                self._unlink(Path(entry.path), "torn")
                continue
            found.append((st.st_mtime, key))
        for _, key in sorted(found):
            self.index[key] = None
        self._trim()
        if self.index:
            log.info("memsvc: disk tier %s: %d blocks (%.1f MiB) from before", self.dir, len(self.index),
                     self.bytes / 2**20)

    def _unlink(self, path: Path, reason: str) -> None:
        self.stats.error(reason)
        try:
            path.unlink()
        except OSError as exc:
            log.warning("memsvc: disk tier: cannot delete %s: %s", path, exc)

    def _trim(self) -> None:
        with self._mutex:
            drop = []
            while self.bytes > self.capacity and self.index:
                key, event = self.index.popitem(last=False)
                drop.append(key)
                if event is not None:
                    self.removed.append(event)
        for key in drop:
            try:
                self._path(key).unlink()
            except OSError as exc:
                self._failed("delete", exc)

    def __contains__(self, key: bytes) -> bool:
        with self._mutex:
            return key in self.index

    def __len__(self) -> int:
        return len(self.index)

    def take_removed(self) -> list[bytes]:
        with self._mutex:
            out, self.removed = self.removed, []
        return out

    def write(self, key: bytes, index: int, tokens: np.ndarray, block: Block) -> bool:
        """Write block number `index` (atomically: temporary file, sync, rename); False when
        the disk refused it or holds it already."""
        if not self.writable or key in self:
            return False
        body = [np.asarray(tokens, dtype="<u4").tobytes(), _raw(block.k), _raw(block.v)]
        digest = hashlib.sha256()
        for part in body:
            digest.update(part)
        s = self.shape
        header = HEADER.pack(MAGIC, FORMAT_VERSION, s.block_size, self.identity, key, s.n_layers, s.n_kv_heads,
                              s.head_dim, DTYPE_CODES[s.dtype], index, sum(map(len, body)), digest.digest(),
                              block.event or NO_HASH, block.parent or NO_HASH)
        path = self._path(key)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        try:
            with open(tmp, "wb") as fh:
                fh.write(header)
                for part in body:
                    fh.write(part)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            self._failed("write", exc)
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass  # the directory itself is gone or refused: nothing was left in it
            return False
        with self._mutex:
            self.index[key] = block.event
        self._trim()
        return True

    def read(self, key: bytes) -> Block | None:
        """The block, checked against its header and checksum; None (and the file deleted)
        when anything does not hold."""
        path = self._path(key)
        try:
            data = path.read_bytes()
        except OSError as exc:
            self._failed("read", exc)
            self._forget(key)
            return None
        block = self._decode(key, data)
        if block is None:
            self._forget(key)
            self._unlink(path, "corrupt")
            return None
        with self._mutex:
            if key in self.index:
                self.index.move_to_end(key)
        return block

    def unannounced(self) -> list[tuple[int, bytes, bytes | None, np.ndarray]]:
        """(block index, event hash, parent's, token ids) of the files a previous memsvc left,
        read from their headers, block 0 first; each is then known as announced. A file whose
        header does not hold is left for `read` to drop."""
        with self._mutex:
            keys = [k for k, event in self.index.items() if event is None]
        out = []
        for key in keys:
            try:
                with open(self._path(key), "rb") as fh:
                    head = fh.read(HEADER.size + 4 * self.shape.block_size)
            except OSError:
                continue
            if len(head) != HEADER.size + 4 * self.shape.block_size:
                continue
            fields = HEADER.unpack_from(head)
            if fields[:5] != (MAGIC, FORMAT_VERSION, self.shape.block_size, self.identity, key):
                continue
            event, parent = fields[12], fields[13]
            if event == NO_HASH:
                continue
            tokens = np.frombuffer(head[HEADER.size:], dtype="<u4")
            out.append((fields[9], event, parent if fields[9] > 0 else None, tokens))
            with self._mutex:
                if key in self.index:
                    self.index[key] = event
        return sorted(out, key=lambda t: t[0])

    def _forget(self, key: bytes) -> None:
        with self._mutex:
            event = self.index.pop(key, None)
            if event is not None:
                self.removed.append(event)

    def _decode(self, key: bytes, data: bytes) -> Block | None:
        s = self.shape
        if len(data) != s.file_bytes:
            return None
        (magic, version, block_size, identity, file_key, n_layers, n_kv_heads, head_dim, dtype_code, _,
         body_len, digest, event, parent) = HEADER.unpack_from(data)
        body = memoryview(data)[HEADER.size:]
        if ((magic, version, block_size, identity, file_key) != (MAGIC, FORMAT_VERSION, s.block_size,
                                                                 self.identity, key)
                or (n_layers, n_kv_heads, head_dim, dtype_code) != (s.n_layers, s.n_kv_heads, s.head_dim,
                                                                    DTYPE_CODES[s.dtype])
                or body_len != len(body) or hashlib.sha256(body).digest() != digest):
            return None
        shape = (s.n_layers, s.block_size, s.n_kv_heads, s.head_dim)
        half = s.kv_bytes // 2
        kv = body[4 * s.block_size:]
        dtype = getattr(torch, s.dtype)
        k = torch.frombuffer(bytearray(kv[:half]), dtype=dtype).view(shape)
        v = torch.frombuffer(bytearray(kv[half:]), dtype=dtype).view(shape)
        return Block(k, v, None if event == NO_HASH else event, None if parent == NO_HASH else parent)

    def close(self) -> None:
        os.close(self._lock_fd)


def _raw(t: torch.Tensor) -> bytes:
    """The bytes of a CPU tensor (bfloat16 included, which numpy lacks)."""
    t = t.contiguous()
    return t.view(torch.uint8).numpy().tobytes() if t.dtype.itemsize else b""
