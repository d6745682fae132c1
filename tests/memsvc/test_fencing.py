"""Lease fencing, memsvc's half and the client's clock (docs/interfaces.md, "Lease fencing"):
a lease is reclaimed only after its TTL plus the grace, an expired lease's slots and rows
stay quarantined (held, not reusable, counted by the integrity check) until the
quarantine ends, a dead process's lease is freed at once, and `MemClient.fence` refuses
a write once the TTL has passed since the last *sent* renewal."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from kvserve.memsvc.client import LeaseExpired, MemClient
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
    Step,
)

TTL, GRACE, QUARANTINE = 1.5, 0.5, 2.0
SHAPE = PoolShape(n_layers=1, n_kv_heads=1, head_dim=4, dtype="float32", size=48, max_reqs=4,
                  max_context_len=32, page_size=1)


def _service() -> MemsvcService:
    return MemsvcService(SHAPE, policy="reserve", grow_chunk=4, device="cpu", lease_timeout_s=TTL,
                         lease_grace_s=GRACE, reclaim_quarantine_s=QUARANTINE)


def _ask(svc: MemsvcService, msg: object) -> object:
    return REPLIES.decode(svc.handle(REQUESTS.encode(msg)))


def _attach(svc: MemsvcService, pid: int) -> int:
    reply = _ask(svc, Attach(name=f"r{pid}", pid=pid, host=socket.gethostname(), n_layers=1, n_kv_heads=1,
                             head_dim=4, dtype="float32", protocol=PROTOCOL_VERSION))
    assert isinstance(reply, AttachReply) and reply.lease_ttl_s == TTL
    return reply.lease


def test_expired_lease_is_reclaimed_after_ttl_plus_grace_and_its_slots_quarantined() -> None:
    svc = _service()
    try:
        lease = _attach(svc, os.getpid())  # a live local pid: only silence can expire it
        _ask(svc, Step(lease=lease, admit=[Admit(1, list(range(1, 21)), 4)]))
        held = svc.pool.request_slots
        assert held == 24
        seen = svc.leases[lease].last_seen
        assert svc.reap(seen + TTL + GRACE - 0.01) == 0, "reclaimed before TTL + grace"
        assert svc.reap(seen + TTL + GRACE + 0.01) == 1
        now = seen + TTL + GRACE + 0.01
        assert svc.pool.quarantined_slots == held and svc.pool.request_slots == 0
        free = svc.pool.free_slots
        assert free == 47 - held
        assert check_integrity(svc.pool, repair=False) == []  # quarantined slots count as held
        other = _attach(svc, os.getpid())
        reply = _ask(svc, Step(lease=other, admit=[Admit(1, [9] * 20, 10)]))  # 30 slots > 23 free
        assert not reply.admitted[0].ok
        assert svc.pool.release_quarantine(now + QUARANTINE - 0.01) == 0
        assert svc.pool.release_quarantine(now + QUARANTINE) == held
        assert svc.pool.free_slots == free + held and check_integrity(svc.pool, repair=False) == []
        assert _ask(svc, Step(lease=other, admit=[Admit(1, [9] * 20, 10)])).admitted[0].ok
    finally:
        svc.close()


def test_dead_process_lease_is_freed_at_once() -> None:
    svc = _service()
    try:
        dead = os.fork()
        if dead == 0:
            os._exit(0)
        os.waitpid(dead, 0)
        lease = _attach(svc, dead)
        svc.pool.admit(lease, Admit(1, [1, 2, 3], 2))
        free = svc.pool.free_slots
        assert svc.reap() == 1
        assert svc.pool.quarantined_slots == 0 and svc.pool.free_slots == free + 5
    finally:
        svc.close()


@pytest.mark.timeout(60)
def test_client_fence_follows_the_last_sent_renewal(run_dir: Path, memsvc_factory) -> None:
    with memsvc_factory(run_dir) as svc:
        client = MemClient(svc.address, name="fence", timeout_s=10)
        try:
            client.attach(n_layers=2, n_kv_heads=2, head_dim=8)
            client._stop_heartbeat()  # no renewals but the ones below
            client.fence(0)
            sent = time.monotonic()
            client.step()
            assert sent <= client.valid_until - client.lease_ttl_s <= time.monotonic()
            time.sleep(max(0.0, client.valid_until - time.monotonic()) + 0.01)
            with pytest.raises(LeaseExpired, match="before layer 3's KV write: the lease ran out"):
                client.fence(3)
            assert client.lease_lost
        finally:
            client.close()
