"""KV-cache events in vLLM's wire format, as memsvc publishes them to routers (vllm-router's
`kv_aware` policy; the format is described in docs/interfaces.md and ../shared/ROUTER.md).

A live message is three ZMQ frames `[topic, seq, payload]`: the topic (empty for static
sources), `seq` as 8 bytes big-endian signed, and the payload, a msgpack array `[ts, events]`.
Each event is a msgpack *map* tagged by "type" (not an array: routers refuse tagged arrays),
with every field present even when nil. Block hashes are 32-byte binaries.

Knows msgspec and the format; nothing about the cache or sockets.
"""

from __future__ import annotations

import struct

import msgspec

MEDIUM = "GPU"
"""memsvc's pool is the engine's KV cache (also on a CPU host): full credit at the router."""
MAX_EVENTS_PER_BATCH = 4096
"""The most events a router accepts in one message."""
REPLAY_END_SEQ = -1
"""The seq of the end marker that closes a replay."""


class BlockStored(msgspec.Struct, tag="BlockStored", tag_field="type", frozen=True):
    """Complete blocks now cached: `block_hashes[i]` names block i of the chain,
    `parent_block_hash` the block before the first (nil at the start of a sequence)."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM
    lora_name: str | None = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", frozen=True):
    """Blocks no longer (wholly) cached."""

    block_hashes: list[bytes]
    medium: str | None = MEDIUM


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", frozen=True):
    """Nothing is cached (memsvc started)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(tuple[float, list[KVEvent]])
_SEQ = struct.Struct(">q")


def encode_batch(ts: float, events: list[KVEvent]) -> bytes:
    """The payload frame of one message: `[ts, [event, ...]]`."""
    return _encoder.encode((ts, events))


def decode_batch(payload: bytes) -> tuple[float, list[KVEvent]]:
    """The inverse of `encode_batch` (tests and tools); msgspec.DecodeError when malformed."""
    return _decoder.decode(payload)


def encode_seq(seq: int) -> bytes:
    return _SEQ.pack(seq)
