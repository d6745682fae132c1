"""The tiers below the pool: host RAM and a disk directory, keyed by chained content hashes.

The prefix cache (`radix.RadixCache`) holds KV in pool slots. Below it, in aligned blocks of
`block_size` tokens from position 0:

- the host tier: blocks the pool evicted, in host memory (pinned when the pool is on a GPU),
  bounded in bytes, least recently used dropped first;
- the disk tier: one file per block in a directory, written through as blocks enter the pool
  (so that a memsvc killed at any moment finds on disk what it had cached, up to the writes
  still queued), bounded in bytes, least recently used deleted first, and indexed again by the
  next memsvc: a warm restart.

A block's key is SHA-256 over the model's identity (`identity_digest`: a hash of the model
file, the KV dtype and layout and the block size) followed by the token ids (uint32
little-endian) of the whole sequence up to the block's end: another model, dtype or layout
never finds a block, and a block is found only after the very tokens it was computed on.

A file holds a fixed header (magic, format version, identity, key, shape, body length and
the body's SHA-256) and a body (the block's token ids, K, then V). It is written to a
temporary name, synced and renamed, so a reader never sees a half-written file under its
name; a file whose size, header or checksum does not hold is deleted and counted, never
served. Disk reads and writes run on a worker thread: the memsvc loop never waits on the
disk. `lookup` answers "loading" for a prefix whose next blocks are on disk only and starts
reading them; the runner asks again shortly, and the blocks are then staged in memory.

One memsvc owns a directory at a time (an exclusive `flock` on it; a second is refused).
Files of other identities live in other subdirectories and are left alone.

Knows torch, numpy and files; nothing about requests, leases or the wire.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import struct
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

log = logging.getLogger("kvserve.memsvc")

FORMAT_VERSION = 1
MAGIC = b"KVSVBLK\0"
SUFFIX = ".kvb"
_HEADER = struct.Struct("<8sII32s32sIIIIIQ32s32s32s")
"""magic, version, block size, identity, key, L, H, D, dtype code, block index, body length,
body SHA-256, the block's KV-event hash and its parent's (zeros for block 0)"""
_NO_HASH = bytes(32)
DTYPE_CODES = {"float32": 1, "float16": 2, "bfloat16": 3}
MAX_QUEUED_WRITES = 4096
"""Blocks waiting for the disk writer; above it new writes are dropped (and counted)."""
MAX_STAGED_BYTES = 1 << 30
"""Blocks read from disk and waiting for their request's next admission (oldest dropped)."""
MODEL_HASH_WHOLE = 1 << 30
"""Model files up to this size are hashed whole; larger ones by their size and 64 samples."""
TIERS = ("host", "disk")


class TierError(ValueError):
    """A tier setting that cannot work (the directory is taken, not a directory, ...)."""


@dataclass(frozen=True, slots=True)
class BlockShape:
    """What one block of KV holds: K and V of `block_size` tokens in every layer."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V of one block."""
        item = torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()
        return 2 * self.n_layers * self.block_size * self.n_kv_heads * self.head_dim * item

    @property
    def body_bytes(self) -> int:
        return 4 * self.block_size + self.kv_bytes

    @property
    def file_bytes(self) -> int:
        return _HEADER.size + self.body_bytes


def model_fingerprint(path: Path) -> bytes:
    """SHA-256 of a model: a file (whole up to `MODEL_HASH_WHOLE`, else its size and 64
    evenly spaced 1 MiB samples) or a directory (its config and weight files, by name)."""
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.suffix in (".json", ".safetensors", ".gguf", ".bin"))
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            if size <= MODEL_HASH_WHOLE:
                for chunk in iter(lambda: fh.read(1 << 22), b""):
                    h.update(chunk)
            else:
                for i in range(64):
                    fh.seek(size * i // 64)
                    h.update(fh.read(1 << 20))
    return h.digest()


def identity_digest(model: bytes, shape: BlockShape) -> bytes:
    """The seed of every block key: the model's fingerprint, the KV layout, dtype, block size
    and the format version."""
    text = (f"kvserve-kv-tiers v{FORMAT_VERSION} layers={shape.n_layers} kv_heads={shape.n_kv_heads} "
            f"head_dim={shape.head_dim} dtype={shape.dtype} block={shape.block_size}")
    return hashlib.sha256(model + text.encode()).digest()


def block_keys(identity: bytes, tokens: np.ndarray, block_size: int, last: int) -> list[bytes]:
    """Keys of blocks 0..last-1 of the sequence `tokens`."""
    h = hashlib.sha256(identity)
    ids = np.asarray(tokens[: last * block_size], dtype="<u4")
    out = []
    for i in range(last):
        h.update(ids[i * block_size:(i + 1) * block_size].tobytes())
        out.append(h.digest())
    return out


class TierListener(Protocol):
    """Told what enters and leaves the host ("CPU") and disk ("DISK") tiers, in the terms of
    the KV events routers read (`kv_events.BlockEvents`)."""

    def chain(self, tokens: np.ndarray, first: int, last: int) -> tuple[bytes | None, list[bytes]]:
        """(event hash of block first-1 or None, event hashes of blocks first..last-1) of `tokens`."""

    def tier_stored(self, medium: str, parent: bytes | None, hashes: list[bytes], token_ids: np.ndarray) -> None:
        """Blocks `hashes` (their tokens `token_ids`) are now held in `medium`."""

    def tier_removed(self, medium: str, hashes: list[bytes]) -> None:
        """Blocks `hashes` left `medium`."""


@dataclass(slots=True)
class Block:
    """One block's KV in host memory: k, v of shape [n_layers, block_size, n_kv_heads, head_dim];
    `event` its KV-event hash (for the host tier's removal event), `parent` its parent's."""

    k: torch.Tensor
    v: torch.Tensor
    event: bytes | None = None
    parent: bytes | None = None

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class HostTier:
    """Blocks in host memory, LRU, at most `capacity` bytes."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[bytes, Block] = OrderedDict()
        self.bytes = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self.blocks

    def get(self, key: bytes) -> Block | None:
        block = self.blocks.get(key)
        if block is not None:
            self.blocks.move_to_end(key)
        return block

    def put(self, key: bytes, block: Block) -> list[Block] | None:
        """Keep `block` (None when it is not taken: held already, or larger than the bound);
        the blocks dropped to make room."""
        if key in self.blocks or block.nbytes > self.capacity:
            return None
        self.blocks[key] = block
        self.bytes += block.nbytes
        dropped = []
        while self.bytes > self.capacity:
            _, old = self.blocks.popitem(last=False)
            self.bytes -= old.nbytes
            dropped.append(old)
        return dropped


@dataclass(slots=True)
class TierStats:
    """Counters the metrics follow (per tier where it applies)."""

    hits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))  # tokens
    bytes_in: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))  # into the tier
    bytes_out: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))  # out of it
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TIERS, 0.0))
    errors: dict[str, int] = field(default_factory=dict)  # reason -> count (disk)

    def error(self, reason: str) -> None:
        self.errors[reason] = self.errors.get(reason, 0) + 1


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
        header = _HEADER.pack(MAGIC, FORMAT_VERSION, s.block_size, self.identity, key, s.n_layers, s.n_kv_heads,
                              s.head_dim, DTYPE_CODES[s.dtype], index, sum(map(len, body)), digest.digest(),
                              block.event or _NO_HASH, block.parent or _NO_HASH)
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
                    head = fh.read(_HEADER.size + 4 * self.shape.block_size)
            except OSError:
                continue
            if len(head) != _HEADER.size + 4 * self.shape.block_size:
                continue
            fields = _HEADER.unpack_from(head)
            if fields[:5] != (MAGIC, FORMAT_VERSION, self.shape.block_size, self.identity, key):
                continue
            event, parent = fields[12], fields[13]
            if event == _NO_HASH:
                continue
            tokens = np.frombuffer(head[_HEADER.size:], dtype="<u4")
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
         body_len, digest, event, parent) = _HEADER.unpack_from(data)
        body = memoryview(data)[_HEADER.size:]
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
        return Block(k, v, None if event == _NO_HASH else event, None if parent == _NO_HASH else parent)

    def close(self) -> None:
        os.close(self._lock_fd)


def _raw(t: torch.Tensor) -> bytes:
    """The bytes of a CPU tensor (bfloat16 included, which numpy lacks)."""
    t = t.contiguous()
    return t.view(torch.uint8).numpy().tobytes() if t.dtype.itemsize else b""


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
