"""memsvc refuses an Attach of another protocol version (an ErrorReply naming both versions,
no lease): a newer one, and one of the old shape, which carries no version and so is
version 1, from before lease fencing (such a runner would not stop writing KV when its
lease runs out)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import msgpack
import pytest
import zmq

from kvserve.memsvc.client import MemClient
from kvserve.messages.runner_memsvc import (
    PROTOCOL_VERSION,
    REPLIES,
    REQUESTS,
    Attach,
    ErrorReply,
)


def _ask(address: str, frame: bytes) -> object:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(address)
    try:
        sock.send(frame)
        assert sock.poll(10000), "memsvc did not answer"
        return REPLIES.decode(sock.recv())
    finally:
        sock.close()


@pytest.mark.timeout(120)
def test_attach_of_another_protocol_version_is_refused(run_dir: Path, memsvc_factory) -> None:
    with memsvc_factory(run_dir) as svc:
        probe = MemClient(svc.address, name="probe", timeout_s=10)
        try:
            future = PROTOCOL_VERSION + 1
            attach = Attach(name="r-future", pid=os.getpid(), host=socket.gethostname(), n_layers=2,
                            n_kv_heads=2, head_dim=8, dtype="float32", protocol=future)
            reply = _ask(svc.address, REQUESTS.encode(attach))
            assert isinstance(reply, ErrorReply)
            assert f"attach: protocol version {future} != memsvc's {PROTOCOL_VERSION}" in reply.error
            after = probe.stats()
            assert (after.clients, after.leases, after.bad_messages) == (0, [], 1)

            # The hand-written codec's Attach: no protocol field, "type" last.
            old = msgpack.packb({"name": "r-old", "pid": os.getpid(), "host": socket.gethostname(),
                                 "n_layers": 2, "n_kv_heads": 2, "head_dim": 8, "dtype": "float32",
                                 "type": "Attach"})
            reply = _ask(svc.address, old)
            assert isinstance(reply, ErrorReply)
            assert f"attach: protocol version 1 != memsvc's {PROTOCOL_VERSION}" in reply.error
            after = probe.stats()
            assert (after.clients, after.leases, after.bad_messages) == (0, [], 2)
            # what MemClient sends is this version, and the lease comes with its TTL
            probe.attach(n_layers=2, n_kv_heads=2, head_dim=8)
            assert probe.lease_ttl_s > 0 and probe.stats().leases == ["probe"]
        finally:
            probe.close()
