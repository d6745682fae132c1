"""The physical layer: KV buffers and the request-to-token table, in shareable memory.

`KVStorage` holds ``k_buffer`` / ``v_buffer`` of shape ``[n_layers, size, n_kv_heads,
head_dim]`` (one token = one slot; slot 0 is a dummy target for padded tokens and is never
allocated). `ReqToTokenPool` holds ``req_to_token[max_reqs, max_context_len]`` int32:
row = request, column = position, value = slot.

These classes have no knowledge of requests, allocation policies or scheduling: memsvc
allocates them once at start and exports their buffers; runners map them.
"""

from __future__ import annotations

import torch

from kvserve.memsvc.sharing import SharedBuffer
from kvserve.messages.runner_memsvc import BufferHandle


class KVStorage:
    """K and V buffers of every layer, allocated once in shareable memory."""

    def __init__(self, *, n_layers: int, size: int, n_kv_heads: int, head_dim: int,
                 dtype: str, device: str) -> None:
        shape = (n_layers, size, n_kv_heads, head_dim)
        self._k = SharedBuffer("k_buffer", shape, dtype, device)
        self._v = SharedBuffer("v_buffer", shape, dtype, device)
        self.size = size

    @property
    def k_buffer(self) -> torch.Tensor:
        return self._k.tensor

    @property
    def v_buffer(self) -> torch.Tensor:
        return self._v.tensor

    def handles(self) -> list[BufferHandle]:
        return [self._k.handle(), self._v.handle()]

    def close(self) -> None:
        self._k.close()
        self._v.close()


class ReqToTokenPool:
    """The ``req_to_token`` table; memsvc is its only writer."""

    def __init__(self, *, max_reqs: int, max_context_len: int, device: str) -> None:
        self._buf = SharedBuffer("req_to_token", (max_reqs, max_context_len), "int32", device)
        self.max_reqs = max_reqs
        self.max_context_len = max_context_len

    @property
    def req_to_token(self) -> torch.Tensor:
        return self._buf.tensor

    def handles(self) -> list[BufferHandle]:
        return [self._buf.handle()]

    def close(self) -> None:
        self._buf.close()
