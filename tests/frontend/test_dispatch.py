"""Dispatcher logic without processes: a client that stops reading fails its call with
RESOURCE_EXHAUSTED instead of queueing without bound, and a dead internal loop is fatal
(the frontend exits non-zero, and the watchdog is no longer fed)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from kvserve.frontend import dispatch
from kvserve.frontend.dispatch import Code, Dispatcher, Failure
from kvserve.frontend.router import Router
from kvserve.messages.frontend_runner import Hello, SamplingParams, TokenBatch, TokenOut


def _dispatcher(tmp_path: Path, **kw) -> Dispatcher:
    return Dispatcher(f"ipc://{tmp_path / 'f.sock'}", Router(is_alive=lambda pid: True), **kw)


def test_unread_outputs_fail_the_call_with_resource_exhausted(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "QUEUE_LIMIT", 3)

    async def scenario() -> list:
        d = _dispatcher(tmp_path)
        d.start()
        d.router.hello(Hello(runner_id="a", pid=1, max_context_len=64), 0.0)
        d._send = lambda runner_id, frame: True  # no runner process: the send is not the point
        p = d.submit("req", [1, 2], SamplingParams())
        for i in range(5):
            d._handle("a", TokenBatch(runner_id="a", outputs=[TokenOut(request_id=p.wire_id, token_ids=[i])]))
        events = [p.queue.get_nowait() for _ in range(p.queue.qsize())]
        assert "req" not in d.pending and p.wire_id not in d.router.owner
        await d.close()
        return events

    events = asyncio.run(scenario())
    assert len(events) == 1 and isinstance(events[0], Failure), events
    assert events[0].code == Code.RESOURCE_EXHAUSTED and "did not read" in events[0].message


def test_a_dead_internal_loop_is_fatal(tmp_path: Path) -> None:
    fatal: list[BaseException] = []

    def broken(pid: int) -> bool:
        raise RuntimeError("liveness check broke")

    async def scenario() -> bool:
        d = Dispatcher(f"ipc://{tmp_path / 'f.sock'}", Router(is_alive=broken), on_fatal=fatal.append)
        d.start()
        assert d.healthy()
        d.router.hello(Hello(runner_id="a", pid=1, max_context_len=64), time.monotonic() + 60)
        for _ in range(50):
            await asyncio.sleep(dispatch.REAP_INTERVAL_S)
            if fatal:
                break
        healthy = d.healthy()
        await d.close()
        return healthy

    assert asyncio.run(scenario()) is False
    assert len(fatal) == 1 and "liveness check broke" in str(fatal[0])


def test_a_request_for_an_unreachable_runner_goes_to_a_reachable_one(tmp_path: Path) -> None:
    """ROUTER_MANDATORY: a send to a runner the socket cannot reach fails loudly (zmq.asyncio
    reports it in the returned future), and the request moves on instead of vanishing."""
    import zmq

    from kvserve.messages.frontend_runner import DOWN, GenerateReq

    async def scenario() -> tuple[str, object]:
        d = _dispatcher(tmp_path)
        d.start()
        peer = zmq.Context.instance().socket(zmq.DEALER)
        peer.setsockopt(zmq.IDENTITY, b"b-real")
        peer.linger = 0
        peer.connect(d.address)
        peer.send(b"hello")  # the ROUTER learns the route once the peer has spoken (a bad frame)
        await asyncio.sleep(0.2)
        now = time.monotonic()
        d.router.hello(Hello(runner_id="a-ghost", pid=1, max_context_len=64), now)  # picked first
        d.router.hello(Hello(runner_id="b-real", pid=1, max_context_len=64), now)
        p = d.submit("req", [1, 2], SamplingParams())
        got = DOWN.decode(peer.recv()) if peer.poll(2000) else None
        peer.close(0)
        await d.close()
        return p.runner_id, got, p.wire_id

    runner_id, got, wire_id = asyncio.run(scenario())
    assert runner_id == "b-real"
    assert isinstance(got, GenerateReq) and got.request_id == wire_id and got.token_ids == [1, 2]
