"""Messages between runners and memsvc (ZMQ ROUTER at memsvc, DEALER per client socket).

Every request frame is one msgpack map (shape: `kvserve.wire`), decoded by `REQUESTS`;
memsvc answers each request with exactly one frame, decoded by `REPLIES`: the matching
``*Reply`` or an `ErrorReply` naming what was wrong. A client sends one frame per message
and no empty delimiter frame. A change of shape bumps `PROTOCOL_VERSION`, which `Attach`
carries; memsvc refuses a client of another version.

Requests: `Attach` (layout check, buffer handles, starts a lease), `Step` (a batch of
`Admit` / `Grow` / `Commit` / `Release` items, processed release, commit, grow, admit),
`Heartbeat`, `Detach`, `Stats`.

This module only describes the messages; it knows nothing about pools, trees or sockets.
"""

from __future__ import annotations

import msgspec

from kvserve.wire import Codec, Item, Message

PROTOCOL_VERSION = 3
"""The shape and meaning of this link's messages; `Attach.protocol` carries the client's.
Version 2: `AttachReply.lease_ttl_s`, which the runner must honour (lease fencing).
Version 3: `AdmitResult.reason` may be `REASON_LOADING` (the KV tiers), which the runner
must retry."""

REASON_EXHAUSTED = "exhausted"
"""`AdmitResult.reason` / `GrowResult.reason` when the pool (slots or rows) is full now."""
REASON_LOADING = "loading"
"""`AdmitResult.reason` while memsvc reads the prompt's cached blocks from its disk tier:
ask again shortly (the request keeps its place; others go on)."""


class Layout(Item):
    """The pool's shape, fixed for the life of one memsvc instance."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str
    size: int  # slots, including the reserved slot(s) of page 0
    page_size: int
    max_reqs: int
    max_context_len: int
    device: str
    policy: str
    grow_chunk: int


class CudaHandle(Item):
    """The parts of a CUDA IPC export (torch reduce_tensor) a runner needs to open it."""

    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


class BufferHandle(Item):
    """Where one shared buffer lives. kind "memfd": open /proc/<pid>/fd/<fd> and map
    `nbytes`; kind "cuda": open `cuda` as an IPC handle."""

    name: str  # "k_buffer", "v_buffer", "req_to_token"
    kind: str  # "memfd" | "cuda"
    shape: list[int]
    dtype: str
    nbytes: int
    pid: int = 0
    fd: int = -1
    cuda: CudaHandle | None = None


class Attach(Message):
    name: str
    pid: int
    host: str
    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str
    protocol: int = 1  # absent: version 1, whose clients did not send it; MemClient sends its own


class AttachReply(Message):
    lease: int
    layout: Layout
    buffers: list[BufferHandle]
    kv_usage: float = 0.0
    memsvc_pid: int = 0  # set when the client is on memsvc's host: it watches this pid
    lease_ttl_s: float = 0.0
    """The lease lives this long after memsvc received the client's last Step or Heartbeat.
    The client writes no KV once that long has passed since it *sent* the last request
    memsvc answered (docs/interfaces.md, "Lease fencing")."""


class Admit(Item, gc=False):
    """Match the cached prefix of token_ids[:-1], lock it, allocate the rest, write the row."""

    request_id: int
    token_ids: list[int]
    max_new_tokens: int


class Grow(Item, gc=False):
    """Make the request's row hold at least `capacity` slots."""

    request_id: int
    capacity: int


class Commit(Item, gc=False):
    """KV of positions [0, len(token_ids)) is written: insert it into the prefix cache."""

    request_id: int
    token_ids: list[int]


class Release(Item, gc=False):
    """Optional final commit, then unlock and free everything the request holds."""

    request_id: int
    token_ids: list[int] | None = None


class AdmitResult(Item, gc=False):
    request_id: int
    ok: bool
    row: int = -1
    cached_len: int = 0
    capacity: int = 0
    reason: str = ""


class GrowResult(Item, gc=False):
    request_id: int
    ok: bool
    capacity: int = 0
    reason: str = ""


class Step(Message, gc=False):
    lease: int
    admit: list[Admit] = msgspec.field(default_factory=list)
    grow: list[Grow] = msgspec.field(default_factory=list)
    commit: list[Commit] = msgspec.field(default_factory=list)
    release: list[Release] = msgspec.field(default_factory=list)


class StepReply(Message, gc=False):
    admitted: list[AdmitResult] = msgspec.field(default_factory=list)
    grown: list[GrowResult] = msgspec.field(default_factory=list)
    errors: list[str] = msgspec.field(default_factory=list)
    kv_usage: float = 0.0


class Heartbeat(Message, gc=False):
    lease: int


class HeartbeatReply(Message, gc=False):
    kv_usage: float = 0.0


class Detach(Message):
    lease: int


class DetachReply(Message):
    rows_released: int = 0


class Stats(Message):
    pass


class StatsReply(Message):
    """A snapshot of the pool; slot counts exclude the reserved page 0."""

    policy: str
    slots_total: int
    slots_free: int
    slots_request: int
    slots_cached: int
    slots_evictable: int
    rows_used: int
    clients: int
    leases: list[str]
    leases_reclaimed: int
    invariant_violations: int
    bad_messages: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    kv_usage: float
    slots_quarantined: int = 0  # reclaimed from an expired lease, not yet reusable


class ErrorReply(Message):
    error: str


Request = Attach | Step | Heartbeat | Detach | Stats
Reply = AttachReply | StepReply | HeartbeatReply | DetachReply | StatsReply | ErrorReply

REPLIES: Codec[Reply] = Codec(AttachReply, StepReply, HeartbeatReply, DetachReply, StatsReply,
                              ErrorReply, direction="reply")
REQUESTS: Codec[Request] = Codec(Attach, Step, Heartbeat, Detach, Stats, direction="request",
                                 other=REPLIES)
