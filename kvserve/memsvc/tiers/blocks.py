"""What the tiers store and how a block is named: the block's shape and its KV in host
memory, the model's fingerprint and the chained block keys, the disk file's header layout,
the counters and the listener the KV events hear.

Knows torch, numpy and hashes; nothing about the pool, the disk's files or the wire."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

FORMAT_VERSION = 1
MAGIC = b"KVSVBLK\0"
SUFFIX = ".kvb"
HEADER = struct.Struct("<8sII32s32sIIIIIQ32s32s32s")
"""magic, version, block size, identity, key, L, H, D, dtype code, block index, body length,
body SHA-256, the block's KV-event hash and its parent's (zeros for block 0)"""
NO_HASH = bytes(32)
DTYPE_CODES = {"float32": 1, "float16": 2, "bfloat16": 3}
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
        return HEADER.size + self.body_bytes


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
