"""A fake runner for frontend tests: a DEALER thread that speaks kvserve.messages.frontend_runner.

It "generates" the UTF-8 bytes of `reply` one token per step (the frontend runs with the
byte tokenizer), then EOS (256). It reports the pid of its own `sleep` child in `Hello`,
so `kill()` makes the frontend see the runner die at once; `stall(s)` makes it freeze for
`s` seconds like a SIGSTOPped runner (nothing sent or read), after which it goes on with
the requests it had, as a zombie would. It repeats its Hello every `HELLO_INTERVAL_S`, as
the real runner does. Everything it receives is recorded in `received` for assertions.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from kvserve.messages.frontend_runner import (
    DOWN,
    HELLO_INTERVAL_S,
    UP,
    AbortReq,
    FinishReason,
    GenerateReq,
    Hello,
    RunnerStatus,
    TokenBatch,
    TokenLogprob,
    TokenOut,
)

EOS = 256


def fake_logprob(tok: int, n: int) -> TokenLogprob:
    """The logprobs a FakeRunner with `with_logprobs` reports for token `tok` when the
    request asks for `n`: every id paired with a value of its own (exact in float32)."""
    return TokenLogprob(
        logprob=-0.125 - (tok % 7) / 8,
        top_ids=[(tok + j) % (EOS + 1) for j in range(n)],
        top_logprobs=[-1.0 - j - ((tok + j) % (EOS + 1)) / 1024 for j in range(n)],
    )


@dataclass
class _Req:
    req: GenerateReq
    produced: int = 0


@dataclass
class FakeRunner:
    address: str
    runner_id: str
    reply: str = "Hello, wörld! 你好 and more text to fill the stream."
    reply_ids: list[int] | None = None  # the token ids to send instead of `reply`'s bytes
    step_s: float = 0.02
    hold: bool = False  # accept requests but never produce tokens
    max_context_len: int = 4096
    received: list = field(default_factory=list)
    with_logprobs: bool = False  # report `fake_logprob` for requests that ask for logprobs
    fail_with: tuple[str, str] | None = None  # (error, error_code): fail each request at its first step
    # cached_tokens it reports for a request (a real runner: the prompt's prefix-cache hit)
    cached_of: Callable[[GenerateReq], int] = lambda req: 2

    def __post_init__(self) -> None:
        self._sleeper = subprocess.Popen(["sleep", "600"])
        self._stop = threading.Event()
        self._stalled_until = 0.0
        self._lock = threading.Lock()
        self._running: dict[str, _Req] = {}
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    @property
    def pid(self) -> int:
        return self._sleeper.pid

    def generate_reqs(self) -> list[GenerateReq]:
        with self._lock:
            return [m for m in self.received if isinstance(m, GenerateReq)]

    def aborts(self) -> list[str]:
        with self._lock:
            return [m.request_id for m in self.received if isinstance(m, AbortReq)]

    def wait_for(self, predicate, timeout: float = 5.0) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if predicate():
                return True
            time.sleep(0.01)
        return predicate()

    def stall(self, seconds: float) -> None:
        """Freeze (send nothing, read nothing) for `seconds`, then go on."""
        self._stalled_until = time.monotonic() + seconds

    def kill(self) -> None:
        """Die like a killed runner: the pid disappears and nothing more is sent."""
        self._stop.set()
        self._thread.join(timeout=5)
        if self._sleeper.poll() is None:
            self._sleeper.kill()
        self._sleeper.wait()

    close = kill

    def _loop(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.runner_id.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        hello = UP.encode(Hello(runner_id=self.runner_id, pid=self.pid, max_context_len=self.max_context_len))
        sock.send(hello)
        last_status = 0.0
        last_hello = next_step = time.monotonic()
        try:
            while not self._stop.is_set():
                if time.monotonic() < self._stalled_until:
                    time.sleep(0.005)
                    continue
                if time.monotonic() - last_hello >= HELLO_INTERVAL_S:
                    sock.send(hello)
                    last_hello = time.monotonic()
                if sock.poll(5):
                    msg = DOWN.decode(sock.recv())
                    with self._lock:
                        self.received.append(msg)
                        if isinstance(msg, GenerateReq):
                            self._running[msg.request_id] = _Req(msg)
                        else:
                            self._running.pop(msg.request_id, None)
                now = time.monotonic()
                if now - last_status > 0.1:
                    with self._lock:
                        n = len(self._running)
                    sock.send(UP.encode(RunnerStatus(runner_id=self.runner_id, running=n,
                                                     waiting=0, kv_usage=0.0)))
                    last_status = now
                if now >= next_step:
                    next_step = now + self.step_s
                    outs = self._step()
                    if outs:
                        sock.send(UP.encode(TokenBatch(runner_id=self.runner_id, outputs=outs)))
        finally:
            sock.close(0)
            ctx.term()

    def _step(self) -> list[TokenOut]:
        if self.hold:
            return []
        data = self.reply.encode() if self.reply_ids is None else self.reply_ids
        outs = []
        with self._lock:
            for request_id, r in list(self._running.items()):
                p = r.req.params
                if self.fail_with is not None:
                    error, code = self.fail_with
                    outs.append(TokenOut(request_id=request_id, token_ids=[], finish_reason=FinishReason.ERROR,
                                         error=error, error_code=code))
                    del self._running[request_id]
                    continue
                tok = data[r.produced] if r.produced < len(data) else EOS
                r.produced += 1
                reason = ""
                if tok == EOS and not p.ignore_eos:
                    reason = FinishReason.STOP
                elif tok in p.stop_token_ids:
                    reason = FinishReason.STOP
                elif r.produced >= p.max_new_tokens:
                    reason = FinishReason.LENGTH
                outs.append(TokenOut(request_id=request_id, token_ids=[tok], finish_reason=reason,
                                     cached_tokens=self.cached_of(r.req),
                                     queue_time=0.001 if r.produced == 1 else 0.0,
                                     logprobs=[fake_logprob(tok, p.logprobs)]
                                     if self.with_logprobs and p.logprobs > 0 else []))
                if reason:
                    del self._running[request_id]
        return outs
