"""The host tier: blocks the pool evicted, in host memory, least recently used dropped first.

Knows blocks and bytes; nothing about the disk, the pool or requests."""

from __future__ import annotations

from collections import OrderedDict

from kvserve.memsvc.tiers.blocks import Block


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
