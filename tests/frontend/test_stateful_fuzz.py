"""The frontend's runner socket survives any frame (issue 15, item 1): a hypothesis state
machine submits requests to a `Dispatcher` and feeds it random messages as runners would
send them (Hello, RunnerStatus, TokenBatch for live, finished and made-up attempts, from
the owner and from others, under the right socket identity and a spoofed one) and garbage,
while time passes and runners die. After every frame: nothing raised, every request's
queue is bounded, the router's assignments and the dispatcher's attempts agree, and no
output from a runner that does not own an attempt reached its request. At least 10,000
frames are sent."""

from __future__ import annotations

import time
from pathlib import Path

import msgpack
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvserve.frontend import dispatch
from kvserve.frontend.dispatch import Dispatcher, Failure
from kvserve.frontend.router import Router
from kvserve.messages.frontend_runner import (
    UP,
    Hello,
    RunnerStatus,
    SamplingParams,
    TokenBatch,
    TokenLogprob,
    TokenOut,
)
from tests.stateful import drive

FRAMES = {"sent": 0}
RUNNERS = ["r0", "r1", "r2"]
wild = st.integers(-(2**63), 2**63 - 1)
runner_ids = st.sampled_from(RUNNERS)
reasons = st.sampled_from(["", "", "", "stop", "length", "abort", "error", "bogus"])
logprobs = st.lists(st.builds(TokenLogprob, st.floats(), st.lists(wild, max_size=2),
                              st.lists(st.floats(), max_size=3)), max_size=2)
garbage = st.one_of(
    st.binary(max_size=48),
    st.dictionaries(st.sampled_from(["type", "runner_id", "outputs", "pid", "protocol"]),
                    st.one_of(st.text(max_size=5), wild, st.lists(wild, max_size=3)),
                    max_size=4).map(msgpack.packb),
)


class DispatcherMachine(RuleBasedStateMachine):
    @initialize()
    def start(self) -> None:
        self.path = Path(f"/tmp/kvserve-fuzz-{id(self)}.sock")
        self.d = Dispatcher(f"ipc://{self.path}", Router(is_alive=lambda pid: pid < 1000))
        self.d._send = lambda runner_id, frame: True  # the socket is not the point: the handling is
        self.now = time.monotonic()
        self.pending: list = []

    def teardown(self) -> None:
        self.d._sock.close(0)
        self.d._ctx.term()

    def _frames(self, identity: str, body: bytes) -> None:
        FRAMES["sent"] += 1
        self.d.take_frames([identity.encode(), body])

    @rule(runner=runner_ids, pid=st.one_of(st.integers(1, 5), wild), spoof=st.booleans(),
          protocol=st.sampled_from([2, 2, 1, 3]))
    def hello(self, runner: str, pid: int, spoof: bool, protocol: int) -> None:
        identity = "r9" if spoof else runner
        self._frames(identity, UP.encode(Hello(runner_id=runner, pid=pid, max_context_len=64, protocol=protocol)))

    @rule(runner=runner_ids, running=wild, kv=st.floats())
    def status(self, runner: str, running: int, kv: float) -> None:
        self._frames(runner, UP.encode(RunnerStatus(runner_id=runner, running=running, waiting=0, kv_usage=kv)))

    @rule(n=st.integers(1, 3))
    def submit(self, n: int) -> None:
        for _ in range(n):
            try:
                self.pending.append(self.d.submit(f"c{FRAMES['sent']}-{len(self.pending)}", [1, 2],
                                                  SamplingParams()))
            except dispatch.NoRunner:
                pass

    @precondition(lambda self: self.pending)
    @rule(k=st.integers(0, 50), runner=runner_ids, owner=st.booleans(), ids=st.lists(wild, max_size=3),
          reason=reasons, lps=logprobs, extra_made_up=st.booleans())
    def tokens(self, k: int, runner: str, owner: bool, ids: list, reason: str, lps: list,
               extra_made_up: bool) -> None:
        p = self.pending[k % len(self.pending)]
        sender = p.runner_id if owner and p.runner_id else runner
        outs = [TokenOut(request_id=p.wire_id, token_ids=ids, logprobs=lps, finish_reason=reason)]
        if extra_made_up:
            outs.append(TokenOut(request_id=f"{self.d.incarnation}:999999.1", token_ids=[1]))
        before = p.queue.qsize()
        owns = self.d.router.owner.get(p.wire_id) == sender
        self._frames(sender, UP.encode(TokenBatch(runner_id=sender, outputs=outs)))
        if not owns:
            assert p.queue.qsize() == before, "an output from a runner that does not own the attempt got in"

    @rule(frame=garbage, identity=st.sampled_from(RUNNERS + ["", "x" * 300]), parts=st.integers(1, 3))
    def junk(self, frame: bytes, identity: str, parts: int) -> None:
        FRAMES["sent"] += 1
        self.d.take_frames([identity.encode(), frame][:parts] + [frame] * (parts - 2))

    @rule(dt=st.sampled_from([0.2, 1.0, 2.0]))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        self.d.reap(self.now)

    @rule()
    def client_reads(self) -> None:
        """Each client takes what is queued; a final event ends its call, as grpc_service does."""
        for p in list(self.pending):
            final = False
            while not p.queue.empty():
                event = p.queue.get_nowait()
                final = final or isinstance(event, Failure) or bool(getattr(event, "finish_reason", ""))
            if final:
                self.d.abort(p)
                self.pending.remove(p)

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "d"):
            return
        d = self.d
        assert all(p.queue.qsize() <= dispatch.QUEUE_LIMIT for p in self.pending)
        assert set(d.router.owner) == set(d._by_wire), (d.router.owner, list(d._by_wire))
        for runner_id, st_ in d.router.runners.items():
            assert st_.inflight == {w for w, r in d.router.owner.items() if r == runner_id}


def test_dispatcher_survives_ten_thousand_random_frames() -> None:
    drive(DispatcherMachine, FRAMES)
    assert FRAMES["sent"] >= 10_000
