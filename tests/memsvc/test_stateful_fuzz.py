"""memsvc survives any frame (issue 15, item 1): a hypothesis state machine drives one
`MemsvcService` through real Attach frames and then random Steps (admits, grows, commits,
releases, well-formed and not), heartbeats, detaches, expiries and garbage. After every
frame: `handle` returned a decodable reply (it never raises), and the pool's invariants
hold without repair. The run sends at least 10,000 frames; then a real memsvc process takes
a burst of the same garbage over its socket and still serves.

An attach with a pid past the C int range used to end the process (OverflowError in
os.kill when the lease was reaped); it is refused now, and the reap survives such a pid.
"""

from __future__ import annotations

import os
import random
import socket
import time
from pathlib import Path

import msgpack
import pytest
import zmq
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvserve.memsvc.client import MemClient
from kvserve.memsvc.integrity import check_integrity
from kvserve.memsvc.service import MemsvcService
from kvserve.memsvc.shape import PoolShape
from kvserve.messages.runner_memsvc import (
    PROTOCOL_VERSION,
    REPLIES,
    REQUESTS,
    Admit,
    Attach,
    AttachReply,
    Commit,
    Detach,
    ErrorReply,
    Grow,
    Heartbeat,
    Release,
    Stats,
    Step,
    StepReply,
)
from tests.stateful import drive

SHAPE = PoolShape(n_layers=1, n_kv_heads=1, head_dim=4, dtype="float32", size=64, max_reqs=6,
                  max_context_len=24, page_size=2)
FRAMES = {"sent": 0}
HOST = socket.gethostname()

ids = st.integers(0, 5)
tokens = st.lists(st.integers(0, 7), max_size=30)
wild_ints = st.one_of(st.integers(-(2**63), 2**64 - 1), st.integers(-3, 40))
admits = st.builds(Admit, ids, tokens, st.integers(-2, 30))
grows = st.builds(Grow, ids, st.integers(-5, 40))
commits = st.builds(Commit, ids, tokens)
releases = st.builds(Release, ids, st.one_of(st.none(), tokens))
msgpack_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=6),
              st.binary(max_size=6)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=12,
)
garbage = st.one_of(
    st.binary(max_size=64),
    msgpack_values.map(msgpack.packb),
    st.fixed_dictionaries({"type": st.sampled_from(["Attach", "Step", "Heartbeat", "Detach", "Stats", "Bogus",
                                                    "StepReply"])},
                          optional={"lease": wild_ints, "admit": msgpack_values, "grow": msgpack_values,
                                    "pid": wild_ints, "name": st.text(max_size=4), "protocol": wild_ints,
                                    "n_layers": wild_ints}).map(msgpack.packb),
)


class MemsvcMachine(RuleBasedStateMachine):
    """One service; leases it handed out; a clock the reaper reads."""

    @initialize()
    def start(self) -> None:
        self.svc = MemsvcService(SHAPE, policy="optimistic", grow_chunk=4, device="cpu", lease_timeout_s=1.5,
                                 lease_grace_s=0.5, reclaim_quarantine_s=2.0)
        self.leases: list[int] = []
        self.offset = 0.0  # how far the reaper's clock runs ahead of the real one

    def teardown(self) -> None:
        self.svc.close()

    def _send(self, frame: bytes) -> object:
        FRAMES["sent"] += 1
        reply = REPLIES.decode(self.svc.handle(frame))  # handle never raises; its reply decodes
        return reply

    @rule(pid=st.one_of(st.just(os.getpid()), wild_ints), protocol=st.sampled_from([PROTOCOL_VERSION, 1, 3]),
          head_dim=st.sampled_from([4, 4, 4, 8]))
    def attach(self, pid: int, protocol: int, head_dim: int) -> None:
        room = len(self.svc.leases) < self.svc.max_leases
        reply = self._send(REQUESTS.encode(Attach(name="fuzz", pid=pid, host=HOST, n_layers=1, n_kv_heads=1,
                                                  head_dim=head_dim, dtype="float32", protocol=protocol)))
        good = (protocol == PROTOCOL_VERSION and head_dim == 4 and 0 <= pid <= 1 << 22
                and room)
        assert isinstance(reply, AttachReply) == good, reply
        if good:
            self.leases.append(reply.lease)

    @precondition(lambda self: self.leases)
    @rule(k=st.integers(0, 100), admit=st.lists(admits, max_size=3), grow=st.lists(grows, max_size=3),
          commit=st.lists(commits, max_size=2), release=st.lists(releases, max_size=2))
    def step(self, k: int, admit: list, grow: list, commit: list, release: list) -> None:
        lease = self.leases[k % len(self.leases)]
        reply = self._send(REQUESTS.encode(Step(lease=lease, admit=admit, grow=grow, commit=commit,
                                                release=release)))
        assert isinstance(reply, StepReply | ErrorReply)
        if isinstance(reply, ErrorReply):
            assert "unknown lease" in reply.error, reply  # the lease may have expired meanwhile

    @rule(lease=st.one_of(wild_ints, st.sampled_from([0])), kind=st.sampled_from(["hb", "detach", "stats"]))
    def other(self, lease: int, kind: int) -> None:
        if self.leases and lease == 0:
            lease = self.leases[0]
        msg = {"hb": Heartbeat(lease=lease), "detach": Detach(lease=lease), "stats": Stats()}[kind]
        self._send(REQUESTS.encode(msg))
        if kind == "detach" and lease in self.leases:
            self.leases.remove(lease)

    @rule(frames=st.lists(garbage, min_size=1, max_size=5))
    def junk(self, frames: list[bytes]) -> None:
        for frame in frames:
            assert self._send(frame) is not None

    @rule(dt=st.sampled_from([0.5, 1.0, 2.5]))
    def time_passes(self, dt: float) -> None:
        self.offset += dt  # leases expire, quarantines end
        self.svc.reap(time.monotonic() + self.offset)
        self.leases = [lease for lease in self.leases if lease in self.svc.leases]

    @invariant()
    def pool_holds(self) -> None:
        if hasattr(self, "svc"):
            assert check_integrity(self.svc.pool, repair=False) == []
            assert self.svc.violations == 0


def test_memsvc_survives_ten_thousand_random_frames() -> None:
    drive(MemsvcMachine, FRAMES)
    assert FRAMES["sent"] >= 10_000


@pytest.mark.timeout(120)
def test_a_real_memsvc_takes_garbage_and_still_serves(run_dir: Path, memsvc_factory) -> None:
    rng = random.Random(0)
    with memsvc_factory(run_dir) as svc:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(svc.address)
        burst = [rng.randbytes(rng.randint(0, 64)) for _ in range(100)]
        burst += [msgpack.packb({"type": "Step", "lease": rng.randint(-(2**63), 2**63), "grow": [[1, 2, 3]]})
                  for _ in range(20)]
        burst += [b"", b"\x00" * 100, msgpack.packb({"type": "Attach", "pid": 2**40, "name": "x", "host": HOST,
                                                      "n_layers": 2, "n_kv_heads": 2, "head_dim": 8,
                                                      "dtype": "float32", "protocol": PROTOCOL_VERSION})]
        try:
            for frame in burst * 3:
                sock.send(frame)
                assert sock.poll(5000), "memsvc stopped answering"
                sock.recv()
            sock.send_multipart([b"two", b"frames"])
            assert sock.poll(5000)
            assert "expected 1 frame" in REPLIES.decode(sock.recv()).error
        finally:
            sock.close(0)
        client = MemClient(svc.address, name="after", timeout_s=10)
        try:
            client.attach(n_layers=2, n_kv_heads=2, head_dim=8)
            assert client.step(admit=[Admit(1, [1, 2, 3], 2)]).admitted[0].ok
            st_ = client.stats()
            assert st_.invariant_violations == 0 and st_.bad_messages >= len(burst) * 3
        finally:
            client.close()
        assert svc.proc.poll() is None, "memsvc exited"
