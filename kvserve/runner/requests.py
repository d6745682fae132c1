"""The runner's request table: one `Request` per generation and its scheduling state.

A request's `tokens` are its prompt followed by what it has generated; `computed` counts
the leading tokens whose KV is in its memsvc row. Every forward feeds
``tokens[computed:computed + n]``: a prompt chunk, a recompute after preemption, or the one
new token of a decode, and the request samples when that slice reaches the end of
`tokens`. This module knows nothing about memsvc messages, the model or sockets.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvserve.messages.frontend_runner import SamplingParams
from kvserve.runner.sampling import SampleRow


class State(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    """One generation request inside the scheduler."""

    request_id: str
    prompt_len: int
    tokens: list[int]
    params: SamplingParams
    arrival: float
    stop_ids: frozenset[int]
    max_tokens: int  # len(tokens) at which the request ends ("length")
    sample_row: SampleRow
    state: State = State.WAITING
    mem_id: int = -1
    row: int = -1
    capacity: int = 0
    computed: int = 0
    commit_at: int = 0  # computed length at which this admission's prefill is complete
    committed: bool = True
    admitted_seq: int = -1
    cached_tokens: int = -1  # prompt tokens served from the prefix cache (first admission)
    queue_time: float = -1.0
    first_sent: bool = False
    load_wait_until: float = 0.0  # memsvc reads this prompt's cached blocks: not asked again before

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    def next_extend(self, chunk_size: int, budget: int) -> int:
        """Tokens this request would compute in the next forward, within `budget`."""
        return max(0, min(len(self.tokens) - self.computed, chunk_size, budget))

    def unbind(self) -> None:
        """Forget the memsvc row (after release or preemption)."""
        self.mem_id, self.row, self.capacity, self.computed = -1, -1, 0, 0
        self.committed = True


@dataclass(slots=True)
class RequestTable:
    """Waiting queue (FIFO, preempted requests go to the front) and running set."""

    by_rid: dict[str, Request] = field(default_factory=dict)
    waiting: deque[Request] = field(default_factory=deque)
    running: list[Request] = field(default_factory=list)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.by_rid

    def __len__(self) -> int:
        return len(self.by_rid)

    def add(self, req: Request) -> None:
        self.by_rid[req.request_id] = req
        self.waiting.append(req)

    def start(self, req: Request) -> None:
        req.state = State.RUNNING
        self.running.append(req)

    def requeue_front(self, reqs: list[Request]) -> None:
        """Put `reqs` (in their order) at the head of the waiting queue."""
        for req in reversed(reqs):
            req.state = State.WAITING
            self.waiting.appendleft(req)

    def stop_running(self, req: Request) -> None:
        self.running.remove(req)

    def finish(self, req: Request) -> None:
        """Drop `req` from every structure."""
        if req.state is State.RUNNING:
            self.running.remove(req)
        elif req.state is State.WAITING:
            self.waiting.remove(req)
        req.state = State.FINISHED
        self.by_rid.pop(req.request_id, None)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self.by_rid.values()))
