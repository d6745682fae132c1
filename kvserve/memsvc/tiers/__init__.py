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

The package: `blocks` (shapes, keys, the file header, counters), `host` (the host tier),
`disk` (the disk tier's files), `worker` (its thread), `stack` (`Tiers`, what memsvc holds).
Knows torch, numpy and files; nothing about requests, leases or the wire.
"""

from kvserve.memsvc.tiers.blocks import (
    SUFFIX,
    Block,
    BlockShape,
    TierError,
    TierStats,
    block_keys,
    identity_digest,
    model_fingerprint,
)
from kvserve.memsvc.tiers.disk import DiskTier
from kvserve.memsvc.tiers.host import HostTier
from kvserve.memsvc.tiers.stack import Found, Tiers, TierSettings

__all__ = ["SUFFIX", "Block", "BlockShape", "DiskTier", "Found", "HostTier", "TierError", "TierSettings",
           "TierStats", "Tiers", "block_keys", "identity_digest", "model_fingerprint"]
