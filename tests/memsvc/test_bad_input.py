"""Every kind of bad input gets an error naming it, a counter, no state change, and memsvc
keeps serving."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import zmq

from kvserve.memsvc.client import Admit, Grow, MemClient, MemsvcError, Release
from kvserve.messages.runner_memsvc import REPLIES, StatsReply


def raw(address: str, *frames: bytes) -> dict:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(address)
    try:
        sock.send_multipart(list(frames))
        assert sock.poll(10000), "memsvc did not answer"
        return msgpack.unpackb(sock.recv())
    finally:
        sock.close()


@pytest.mark.timeout(120)
def test_bad_messages_and_items(run_dir: Path, memsvc_factory) -> None:
    with memsvc_factory(run_dir) as svc:
        a = MemClient(svc.address, name="a", timeout_s=10)
        b = MemClient(svc.address, name="b", timeout_s=10)
        try:
            a.attach(n_layers=2, n_kv_heads=2, head_dim=8)
            b.attach(n_layers=2, n_kv_heads=2, head_dim=8)
            row = a.step(admit=[Admit(1, [5, 6, 7], 2)]).admitted[0].row
            before = a.stats()
            table = a.req_to_token.clone()
            assert before.bad_messages == 0

            cases = [
                ((b"\xc1\xff garbage",), "not a msgpack frame"),
                ((msgpack.packb({"type": "Bogus"}),), "unknown message type 'Bogus'"),
                ((msgpack.packb({"type": "Step", "lease": "x"}),), "lease: expected an int"),
                ((msgpack.packb([1, 2]),), "expected a map"),
                ((REPLIES.encode(StatsReply("x", 0, 0, 0, 0, 0, 0, 0, [], 0, 0, 0, 0, 0, 0.0)),), "is a reply"),
                ((b"a", b"b"), "expected 1 frame per message, got 2"),
                ((msgpack.packb({"type": "Step", "lease": 12345}),), "unknown lease"),
            ]
            for frames, text in cases:
                reply = raw(svc.address, *frames)
                assert reply["type"] == "ErrorReply" and text in reply["error"], (text, reply)

            r = b.step(release=[Release(1)])  # a's request_id, not b's
            assert "release request_id 1: not held by this lease" in r.errors[0]
            r = a.step(grow=[Grow(99, 10)])
            assert "grow request_id 99: not held" in r.errors[0]
            r = a.step(admit=[Admit(2, list(range(65)), 1)])
            assert "prompt of 65 tokens is longer than max_context_len 64" in r.errors[0]
            r = a.step(grow=[Grow(1, 1000)])
            assert "capacity 1000 exceeds max_context_len 64" in r.errors[0]
            r = a.step(admit=[Admit(1, [1], 1)])
            assert "request_id already admitted" in r.errors[0]
            r = a.step(admit=[Admit(3, [1, -2], 1)])
            assert "negative token id" in r.errors[0]
            with pytest.raises(MemsvcError, match="layout mismatch: head_dim 16 != pool's 8"):
                MemClient(svc.address, timeout_s=10).attach(n_layers=2, n_kv_heads=2, head_dim=16)

            after = a.stats()
            assert after.bad_messages == before.bad_messages + len(cases) + 7
            assert (after.rows_used, after.slots_free, after.slots_request) == (
                before.rows_used, before.slots_free, before.slots_request)
            assert a.req_to_token.equal(table) and a.req_to_token[row, :3].ne(0).all()

            a.step(release=[Release(1)])
            r = a.step(release=[Release(1)])  # double release
            assert "release request_id 1: not held" in r.errors[0]
            ok = a.step(admit=[Admit(4, [5, 6, 7, 8], 2)])  # still serving
            assert ok.admitted[0].ok and not ok.errors
            assert 'kvserve_memsvc_bad_messages_total' in svc.metrics()
        finally:
            a.close()
            b.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, text", [
    (["--policy", "greedy"], "--policy: 'greedy' is not one of optimistic, reserve"),
    (["--address", "tcp://8.8.8.8:5555"], "not a loopback address"),
])
def test_config_errors_exit_2(args: list[str], text: str, tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "kvserve.cli", "memsvc", *args],
                         capture_output=True, text=True, timeout=50,
                         env={"KVSERVE_RUNTIME_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 2, out.stderr
    assert text in out.stderr
