"""The frontend's side of the runner link: one ZMQ ROUTER socket, one queue per request.

`Dispatcher` binds the ROUTER the runners connect to, decodes their `Hello`,
`RunnerStatus` and `TokenBatch` messages (kvserve.messages.frontend_runner), keeps the `Router`
up to date, delivers each `TokenOut` to its request's bounded asyncio queue, and sends
`GenerateReq` / `AbortReq` down.

Ownership: each attempt to run a request has a wire id of its own, unique to this
frontend incarnation (`<incarnation>:<seq>.<attempt>`), and is assigned to one runner.
Outputs are taken only from that runner for that wire id; any other output is dropped,
counted (`late`: the attempt is over or never was; `not_owner`: another runner holds it)
and, if the runner is still working on it, answered with an `AbortReq`. So a zombie
runner's tokens never reach a retried request, and a client that reuses a request id
never races its previous run.

When a runner dies, its requests that have streamed nothing are retried once on another
live runner; the others get a `Failure` (UNAVAILABLE). A request in flight on two runners
that both died is failed with INTERNAL rather than offered to a third: it may be what
crashes them.

Knows nothing about gRPC, text or tokenizers.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from kvserve.config.curve import ServerKeys, apply_server
from kvserve.frontend.router import Router
from kvserve.messages.frontend_runner import (
    DOWN,
    PROTOCOL_VERSION,
    UP,
    AbortReq,
    GenerateReq,
    Hello,
    RunnerStatus,
    SamplingParams,
    TokenBatch,
    TokenOut,
    hello_protocol,
)
from kvserve.paths import bind_private
from kvserve.wire import MAX_FRAME_BYTES, WireError

log = logging.getLogger("kvserve.frontend")

REAP_INTERVAL_S = 0.1
QUEUE_LIMIT = 4096
"""Outputs one request may have waiting for its client; past that the client is not
reading and the request fails with RESOURCE_EXHAUSTED (nothing grows without bound)."""
MAX_RUNNERS = 256
"""Runners one frontend registers; a Hello beyond that is refused (counted "invalid")."""
MAX_RUNNER_DEATHS = 2
"""A request in flight on this many runners that died is failed with INTERNAL."""


class NoRunner(RuntimeError):
    """No live runner can take the request."""


class Code:
    """Names of the gRPC status codes a `Failure` asks for (this module knows no gRPC)."""

    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"


@dataclass(frozen=True, slots=True)
class Failure:
    """Queue event: the request cannot go on; `code` names the status it ends with."""

    message: str
    code: str = Code.UNAVAILABLE


CHOICE_SEP = "\x1f"
"""Between a request's id and its choice's index: a control character, which no client's id
holds (validation refuses them), so a choice's id is never another request's."""


def choice_id(request_id: str, index: int) -> str:
    """The id choice `index` > 0 of an n > 1 request runs under."""
    return f"{request_id}{CHOICE_SEP}{index}"


@dataclass(frozen=True, slots=True)
class UserAbort:
    """Queue event: the `Abort` RPC asked to stop this request."""


Event = TokenOut | Failure | UserAbort


@dataclass(slots=True)
class Pending:
    """One request the frontend sent to a runner."""

    request_id: str  # the client's
    key: str  # this frontend's: "<incarnation>:<seq>"
    token_ids: list[int]
    params: SamplingParams
    arrival: float
    queue: asyncio.Queue[Event] = field(default_factory=lambda: asyncio.Queue(QUEUE_LIMIT))
    streamed: bool = False
    tried: set[str] = field(default_factory=set)
    deaths: int = 0  # runners that died while running it
    runner_id: str = ""

    @property
    def wire_id(self) -> str:
        """The current attempt's id on the runner link: one attempt per runner tried."""
        return f"{self.key}.{len(self.tried)}"


class Dispatcher:
    """Routes requests to runners and their outputs back; owns the ROUTER socket."""

    def __init__(self, address: str, router: Router,
                 on_runners_changed: Callable[[int], None] = lambda n: None,
                 on_bad_message: Callable[[str], None] = lambda reason: None,
                 on_dropped_output: Callable[[str], None] = lambda reason: None,
                 on_fatal: Callable[[BaseException], None] = lambda exc: None,
                 curve: ServerKeys | None = None) -> None:
        self.address = address
        self.router = router
        self.incarnation = secrets.token_hex(4)
        self.pending: dict[str, Pending] = {}  # by the client's request id
        self._by_wire: dict[str, Pending] = {}
        self._seq = 0
        self._on_change = on_runners_changed
        self._on_bad = on_bad_message  # "malformed" | "protocol" | "invalid" | "internal"
        self._on_dropped = on_dropped_output  # "late" | "not_owner"
        self._on_fatal = on_fatal
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)  # larger: refused before it is read
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable send raises, never vanishes
        if curve is not None:  # only runners whose public key is listed get through
            apply_server(self._sock, self._ctx, curve, name="frontend")
        self._tasks: list[asyncio.Task] = []
        self._live = 0

    def start(self) -> None:
        """Bind the socket (an ipc:// socket file is owner-only, 0600) and start the receive
        and liveness loops (needs a running loop). Either loop ending is fatal: `on_fatal`."""
        bind_private(self._sock, self.address)
        self._tasks = [asyncio.create_task(self._recv_loop(), name="dispatcher-recv"),
                       asyncio.create_task(self._reap_loop(), name="dispatcher-reap")]
        for task in self._tasks:
            task.add_done_callback(self._task_ended)

    def _task_ended(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        exc = task.exception() or RuntimeError(f"{task.get_name()} returned")
        log.critical("internal task %s ended: %r", task.get_name(), exc, exc_info=exc)
        self._on_fatal(exc)

    def healthy(self) -> bool:
        """True while the receive and liveness loops run (the watchdog is fed only then)."""
        return bool(self._tasks) and not any(t.done() for t in self._tasks)

    async def close(self) -> None:
        for task in self._tasks:
            task.remove_done_callback(self._task_ended)
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._sock.close(0)
        self._ctx.term()

    # ---- requests down -----------------------------------------------------------------
    def submit(self, request_id: str, token_ids: list[int], params: SamplingParams) -> Pending:
        """Send a request to the least-loaded live runner; raise NoRunner when there is none."""
        self._seq += 1
        p = Pending(request_id=request_id, key=f"{self.incarnation}:{self._seq}", token_ids=token_ids,
                    params=params, arrival=time.time())
        self._send_to_runner(p)
        self.pending[request_id] = p
        return p

    def _send_to_runner(self, p: Pending) -> None:
        """Start a new attempt of `p` on a live runner it has not tried (NoRunner: none)."""
        while True:
            st = self.router.pick(exclude=frozenset(p.tried))
            if st is None:
                raise NoRunner("no live runner")
            p.tried.add(st.runner_id)
            p.runner_id = st.runner_id
            msg = GenerateReq(request_id=p.wire_id, token_ids=p.token_ids, params=p.params,
                              arrival_time=p.arrival)
            if self._send(st.runner_id, DOWN.encode(msg)):
                self.router.assign(p.wire_id, st.runner_id)
                self._by_wire[p.wire_id] = p
                return

    def _send(self, runner_id: str, frame: bytes) -> bool:
        """False when the runner cannot be reached now (not connected, or its queue full)."""
        try:
            # zmq.asyncio reports a failed NOBLOCK send in the returned (done) future, not by raising
            sent = self._sock.send_multipart([runner_id.encode(), frame], flags=zmq.NOBLOCK)
            exc = sent.exception() if sent.done() else None
        except zmq.ZMQError as err:
            exc = err
        if exc is None:
            return True
        log.warning("send to runner %s failed: %s", runner_id, exc)
        return False

    def _forget(self, p: Pending) -> str | None:
        """Forget `p`; return the runner of its current attempt if it may still run it."""
        if self.pending.get(p.request_id) is p:
            del self.pending[p.request_id]
        self._by_wire.pop(p.wire_id, None)
        return self.router.release(p.wire_id)

    def abort(self, p: Pending) -> None:
        """Tell the runner to drop `p` (if it still runs it) and forget the request."""
        runner_id = self._forget(p)
        if runner_id is not None and runner_id in self.router.runners:
            self._send(runner_id, DOWN.encode(AbortReq(request_id=p.wire_id)))

    def finish(self, p: Pending) -> None:
        """Forget a request the runner has finished on its own."""
        self._forget(p)

    def user_abort(self, request_id: str) -> bool:
        """Stop `request_id` and every other choice of it (`choice_id`); False if none runs."""
        choices = [p for rid, p in self.pending.items()
                   if rid == request_id or rid.startswith(request_id + CHOICE_SEP)]
        for p in choices:
            self._deliver(p, UserAbort())
        return bool(choices)

    # ---- messages up -------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        while True:
            self.take_frames(await self._sock.recv_multipart())

    def take_frames(self, frames: list[bytes]) -> None:
        """Decode and handle one message from a runner (ROUTER frames: identity, body); any
        frame, whatever it holds, is handled or counted and dropped, never raised."""
        if len(frames) != 2:
            self._on_bad("malformed")
            log.warning("malformed message: %d frames, expected 2", len(frames))
            return
        identity = frames[0].decode(errors="replace")
        try:
            msg = UP.decode(frames[1])
        except WireError as exc:
            version = hello_protocol(frames[1])
            if version is not None and version != PROTOCOL_VERSION:
                self._refuse(identity, version)
            else:
                self._on_bad("malformed")
                log.warning("malformed message from runner %r: %s", identity[:64], exc)
            return
        try:
            self._handle(identity, msg)
        except Exception:  # noqa: BLE001 - no frame may end the frontend
            self._on_bad("internal")
            log.exception("handling a %s from runner %r raised", type(msg).__name__, identity[:64])

    def _refuse(self, runner_id: str, version: int) -> None:
        self._on_bad("protocol")
        log.error("runner %s refused: it speaks protocol version %d, this frontend speaks %d",
                  runner_id, version, PROTOCOL_VERSION)

    def _handle(self, identity: str, msg: Hello | RunnerStatus | TokenBatch) -> None:
        now = time.monotonic()
        if msg.runner_id != identity:  # replies go by socket identity: a runner speaks for itself only
            self._on_bad("invalid")
            log.warning("a %s naming runner %r came from socket identity %r: dropped",
                        type(msg).__name__, msg.runner_id[:64], identity[:64])
            return
        if isinstance(msg, Hello):
            if msg.protocol != PROTOCOL_VERSION:
                self._refuse(msg.runner_id, msg.protocol)
                return
            if msg.runner_id not in self.router.runners and len(self.router.runners) >= MAX_RUNNERS:
                self._on_bad("invalid")
                log.error("runner %r refused: %d runners registered already", msg.runner_id[:64], MAX_RUNNERS)
                return
            if msg.runner_id not in self.router.runners:
                log.info("runner %s (pid %d) connected", msg.runner_id, msg.pid)
            self._fail(msg.runner_id, self.router.hello(msg, now))
        elif isinstance(msg, RunnerStatus):
            self.router.status(msg, now)
        else:
            self.router.seen(msg.runner_id, now)
            for out in msg.outputs:
                self._take(msg.runner_id, out)
        self._notify()

    def _take(self, runner_id: str, out: TokenOut) -> None:
        """Deliver `out` if `runner_id` owns its attempt; else drop it, count it, and abort
        the attempt in that runner if it still runs there."""
        p = self._by_wire.get(out.request_id)
        if p is not None and self.router.owner.get(out.request_id) == runner_id:
            p.streamed = p.streamed or bool(out.token_ids)
            self._deliver(p, out)
            return
        reason = "late" if p is None else "not_owner"
        self._on_dropped(reason)
        log.info("dropped an output of %s from runner %s (%s)", out.request_id, runner_id, reason)
        if not out.finish_reason:
            self._send(runner_id, DOWN.encode(AbortReq(request_id=out.request_id)))

    def _deliver(self, p: Pending, event: Event) -> None:
        try:
            p.queue.put_nowait(event)
        except asyncio.QueueFull:
            # the client does not read: fail the call rather than queue without bound
            while not p.queue.empty():
                p.queue.get_nowait()
            p.queue.put_nowait(Failure(f"the client did not read its stream ({QUEUE_LIMIT} outputs waited)",
                                       Code.RESOURCE_EXHAUSTED))
            self.abort(p)

    def _notify(self) -> None:
        n = len(self.router.runners)
        if n != self._live:
            self._live = n
            self._on_change(n)

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            self.reap(time.monotonic())

    def reap(self, now: float) -> None:
        """Drop the runners that went silent or died by `now`; retry or fail their requests."""
        for runner_id, lost in self.router.reap(now).items():
            log.warning("runner %s is gone; %d request(s) in flight", runner_id, len(lost))
            self._fail(runner_id, lost)
        self._notify()

    def _fail(self, runner_id: str, wire_ids: set[str]) -> None:
        """`runner_id` died with these attempts in flight: retry or fail each request."""
        for wire_id in wire_ids:
            p = self._by_wire.pop(wire_id, None)
            if p is None:
                continue
            p.deaths += 1
            if p.deaths >= MAX_RUNNER_DEATHS:
                log.error("request %s was in flight on %d runners that died; failing it", p.request_id, p.deaths)
                self._deliver(p, Failure(f"the request was in flight on {p.deaths} runners that died "
                                         "(it may be what crashes them); not retried", Code.INTERNAL))
                continue
            if not p.streamed:
                try:
                    self._send_to_runner(p)
                    continue
                except NoRunner:
                    pass
            self._deliver(p, Failure(f"runner {runner_id} went away while serving the request"))
