"""The frontend's side of the runner link: one ZMQ ROUTER socket, one queue per request.

`Dispatcher` binds the ROUTER the runners connect to, decodes their `Hello`,
`RunnerStatus` and `TokenBatch` messages (kvserve.messages.frontend_runner), keeps the `Router`
up to date, delivers each `TokenOut` to its request's asyncio queue, and sends
`GenerateReq` / `AbortReq` down. When a runner dies, its requests that have streamed
nothing yet are retried on another live runner; the others get a `Failure`.

Knows nothing about gRPC, text or tokenizers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

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
from kvserve.wire import WireError

log = logging.getLogger("kvserve.frontend")

REAP_INTERVAL_S = 0.1


class NoRunner(RuntimeError):
    """No live runner can take the request."""


@dataclass(frozen=True, slots=True)
class Failure:
    """Queue event: the request cannot go on (its runner died)."""

    message: str


@dataclass(frozen=True, slots=True)
class UserAbort:
    """Queue event: the `Abort` RPC asked to stop this request."""


Event = TokenOut | Failure | UserAbort


@dataclass(slots=True)
class Pending:
    """One request the frontend sent to a runner."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    arrival: float
    queue: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    streamed: bool = False
    tried: set[str] = field(default_factory=set)


class Dispatcher:
    """Routes requests to runners and their outputs back; owns the ROUTER socket."""

    def __init__(self, address: str, router: Router,
                 on_runners_changed: Callable[[int], None] = lambda n: None,
                 on_bad_message: Callable[[str], None] = lambda reason: None) -> None:
        self.address = address
        self.router = router
        self.pending: dict[str, Pending] = {}
        self._on_change = on_runners_changed
        self._on_bad = on_bad_message  # "malformed" | "protocol"
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._tasks: list[asyncio.Task] = []
        self._live = 0

    def start(self) -> None:
        """Bind the socket (an ipc:// socket file is owner-only, 0600) and start the receive
        and liveness loops (needs a running loop)."""
        bind_private(self._sock, self.address)
        self._tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._reap_loop())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._sock.close(0)
        self._ctx.term()

    def submit(self, request_id: str, token_ids: list[int], params: SamplingParams) -> Pending:
        """Send a request to the least-loaded live runner; raise NoRunner when there is none."""
        p = Pending(request_id=request_id, token_ids=token_ids, params=params, arrival=time.time())
        self._send_to_runner(p)
        self.pending[request_id] = p
        return p

    def _send_to_runner(self, p: Pending) -> None:
        st = self.router.pick(exclude=frozenset(p.tried))
        if st is None:
            raise NoRunner("no live runner")
        p.tried.add(st.runner_id)
        self.router.assign(p.request_id, st.runner_id)
        msg = GenerateReq(request_id=p.request_id, token_ids=p.token_ids, params=p.params, arrival_time=p.arrival)
        self._send(st.runner_id, DOWN.encode(msg))

    def _send(self, runner_id: str, frame: bytes) -> None:
        try:
            self._sock.send_multipart([runner_id.encode(), frame], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # runner gone or its queue full: liveness will notice
            log.warning("send to %s failed: %s", runner_id, exc)

    def abort(self, request_id: str) -> None:
        """Tell the runner to drop `request_id` (if it still runs it) and forget the request."""
        self.pending.pop(request_id, None)
        runner_id = self.router.release(request_id)
        if runner_id is not None and runner_id in self.router.runners:
            self._send(runner_id, DOWN.encode(AbortReq(request_id=request_id)))

    def finish(self, request_id: str) -> None:
        """Forget a request the runner has finished on its own."""
        self.pending.pop(request_id, None)
        self.router.release(request_id)

    def user_abort(self, request_id: str) -> bool:
        p = self.pending.get(request_id)
        if p is None:
            return False
        p.queue.put_nowait(UserAbort())
        return True

    async def _recv_loop(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) != 2:
                self._on_bad("malformed")
                log.warning("malformed message: %d frames, expected 2", len(frames))
                continue
            try:
                msg = UP.decode(frames[1])
            except WireError as exc:
                version = hello_protocol(frames[1])
                if version is not None and version != PROTOCOL_VERSION:
                    self._refuse(frames[0].decode(errors="replace"), version)
                else:
                    self._on_bad("malformed")
                    log.warning("malformed message from runner %r: %s", frames[0][:64], exc)
                continue
            self._handle(frames[0].decode(errors="replace"), msg)

    def _refuse(self, runner_id: str, version: int) -> None:
        self._on_bad("protocol")
        log.error("runner %s refused: it speaks protocol version %d, this frontend speaks %d",
                  runner_id, version, PROTOCOL_VERSION)

    def _handle(self, identity: str, msg: Hello | RunnerStatus | TokenBatch) -> None:
        now = time.monotonic()
        if isinstance(msg, Hello):
            if msg.protocol != PROTOCOL_VERSION:
                self._refuse(msg.runner_id, msg.protocol)
                return
            log.info("runner %s (pid %d) connected", msg.runner_id, msg.pid)
            self._fail(msg.runner_id, self.router.hello(msg, now))
        elif isinstance(msg, RunnerStatus):
            self.router.status(msg, now)
        else:
            self.router.seen(msg.runner_id, now)
            for out in msg.outputs:
                p = self.pending.get(out.request_id)
                if p is not None:
                    p.streamed = True
                    p.queue.put_nowait(out)
        self._notify()

    def _notify(self) -> None:
        n = len(self.router.runners)
        if n != self._live:
            self._live = n
            self._on_change(n)

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            for runner_id, lost in self.router.reap(time.monotonic()).items():
                log.warning("runner %s is gone; %d request(s) in flight", runner_id, len(lost))
                self._fail(runner_id, lost)
            self._notify()

    def _fail(self, runner_id: str, request_ids: set[str]) -> None:
        for request_id in request_ids:
            p = self.pending.get(request_id)
            if p is None:
                continue
            if not p.streamed:
                try:
                    self._send_to_runner(p)
                    continue
                except NoRunner:
                    pass
            p.queue.put_nowait(Failure(f"runner {runner_id} went away while serving the request"))
