"""Messages between runners and memsvc (ZMQ ROUTER at memsvc, DEALER per client socket).

Every request frame is one msgpack map made by `CODEC` (see `kvserve.wire`); memsvc answers
each request with exactly one frame: the matching ``*Reply`` or an `ErrorReply` naming
what was wrong. A client sends one frame per message and no empty delimiter frame.

Requests: `Attach` (layout check, buffer handles, starts a lease), `Step` (a batch of
`Admit` / `Grow` / `Commit` / `Release` items, processed release, commit, grow, admit),
`Heartbeat`, `Detach`, `Stats`.

This module only describes the messages; it knows nothing about pools, trees or sockets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.wire import Codec

REASON_EXHAUSTED = "exhausted"
"""`AdmitResult.reason` / `GrowResult.reason` when the pool (slots or rows) is full now."""


@dataclass(slots=True)
class Layout:
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


@dataclass(slots=True)
class CudaHandle:
    """The parts of a CUDA IPC export (torch reduce_tensor) a runner needs to open it."""

    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


@dataclass(slots=True)
class BufferHandle:
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


@dataclass(slots=True)
class Attach:
    name: str
    pid: int
    host: str
    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str


@dataclass(slots=True)
class AttachReply:
    lease: int
    layout: Layout
    buffers: list[BufferHandle]
    kv_usage: float = 0.0
    memsvc_pid: int = 0  # set when the client is on memsvc's host: it watches this pid


@dataclass(slots=True)
class Admit:
    """Match the cached prefix of token_ids[:-1], lock it, allocate the rest, write the row."""

    rid: int
    token_ids: list[int]
    max_new_tokens: int


@dataclass(slots=True)
class Grow:
    """Make the request's row hold at least `capacity` slots."""

    rid: int
    capacity: int


@dataclass(slots=True)
class Commit:
    """KV of positions [0, len(token_ids)) is written: insert it into the prefix cache."""

    rid: int
    token_ids: list[int]


@dataclass(slots=True)
class Release:
    """Optional final commit, then unlock and free everything the request holds."""

    rid: int
    token_ids: list[int] | None = None


@dataclass(slots=True)
class AdmitResult:
    rid: int
    ok: bool
    row: int = -1
    cached_len: int = 0
    capacity: int = 0
    reason: str = ""


@dataclass(slots=True)
class GrowResult:
    rid: int
    ok: bool
    capacity: int = 0
    reason: str = ""


@dataclass(slots=True)
class Step:
    lease: int
    admit: list[Admit] = field(default_factory=list)
    grow: list[Grow] = field(default_factory=list)
    commit: list[Commit] = field(default_factory=list)
    release: list[Release] = field(default_factory=list)


@dataclass(slots=True)
class StepReply:
    admitted: list[AdmitResult] = field(default_factory=list)
    grown: list[GrowResult] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    kv_usage: float = 0.0


@dataclass(slots=True)
class Heartbeat:
    lease: int


@dataclass(slots=True)
class HeartbeatReply:
    kv_usage: float = 0.0


@dataclass(slots=True)
class Detach:
    lease: int


@dataclass(slots=True)
class DetachReply:
    rows_released: int = 0


@dataclass(slots=True)
class Stats:
    pass


@dataclass(slots=True)
class StatsReply:
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


@dataclass(slots=True)
class ErrorReply:
    error: str


CODEC = Codec(
    Attach, AttachReply, Step, StepReply, Heartbeat, HeartbeatReply, Detach, DetachReply,
    Stats, StatsReply, ErrorReply,
)
