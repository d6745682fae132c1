"""Lease fencing, memsvc's half and the client's clock (docs/interfaces.md, "Lease fencing"):
a lease is reclaimed only after its TTL plus the grace, an expired lease's slots and rows
stay quarantined (held, not reusable, counted by the integrity check) until the
quarantine ends (a local process's: until it exits or attaches again), a dead process's
lease is freed at once, and `MemClient.fence` refuses
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


def _attach(svc: MemsvcService, pid: int, host: str | None = None) -> int:
    reply = _ask(svc, Attach(name=f"r{pid}", pid=pid, host=host or socket.gethostname(), n_layers=1,
                             n_kv_heads=1, head_dim=4, dtype="float32", protocol=PROTOCOL_VERSION))
    assert isinstance(reply, AttachReply) and reply.lease_ttl_s == TTL
    return reply.lease


def _expire(svc: MemsvcService, pid: int, host: str | None = None) -> tuple[float, int]:
    """Attach as (pid, host), admit a 24-slot row, let the lease expire: (the time, slots held)."""
    lease = _attach(svc, pid, host)
    _ask(svc, Step(lease=lease, admit=[Admit(1, list(range(1, 21)), 4)]))
    held = svc.pool.request_slots
    assert held == 24
    seen = svc.leases[lease].last_seen
    assert svc.reap(seen + TTL + GRACE - 0.01) == 0, "reclaimed before TTL + grace"
    assert svc.reap(seen + TTL + GRACE + 0.01) == 1
    assert svc.pool.quarantined_slots == held and svc.pool.request_slots == 0
    assert svc.pool.free_slots == 47 - held
    assert check_integrity(svc.pool, repair=False) == []  # quarantined slots count as held
    return seen + TTL + GRACE + 0.01, held


def _admit_30(svc: MemsvcService, lease: int) -> bool:
    return _ask(svc, Step(lease=lease, admit=[Admit(1, [9] * 20, 10)])).admitted[0].ok


def test_remote_expired_lease_is_quarantined_for_the_configured_time() -> None:
    svc = _service()
    try:
        now, held = _expire(svc, 4242, host="another-host")  # memsvc cannot watch its process
        other = _attach(svc, 0)
        assert not _admit_30(svc, other), "30 slots > 23 free: the quarantine must be held"
        assert svc.pool.release_quarantine(now + QUARANTINE - 0.01) == 0
        assert svc.pool.release_quarantine(now + QUARANTINE) == held
        assert svc.pool.free_slots == 47 and check_integrity(svc.pool, repair=False) == []
        assert _admit_30(svc, other)
    finally:
        svc.close()


def test_stalled_local_process_keeps_its_slots_until_it_attaches_again() -> None:
    """A local runner's expired lease stays quarantined past `reclaim_quarantine_s` while its
    process lives (it may be stopped between a fence check and its KV store); its next
    Attach, made from its loop once the stalled step is over, frees them."""
    svc = _service()
    try:
        now, held = _expire(svc, os.getpid())
        assert svc.reap(now + QUARANTINE + 60) == 0
        other = _attach(svc, 0)
        assert svc.pool.quarantined_slots == held and not _admit_30(svc, other)
        _attach(svc, os.getpid())
        assert svc.pool.quarantined_slots == 0 and svc.pool.free_slots == 47
        assert _admit_30(svc, other) and check_integrity(svc.pool, repair=False) == []
    finally:
        svc.close()


def test_stalled_local_process_that_exits_frees_its_slots_at_the_next_reap() -> None:
    svc = _service()
    child = os.fork()
    if child == 0:
        time.sleep(60)
        os._exit(0)
    try:
        now, held = _expire(svc, child)
        assert svc.reap(now + QUARANTINE + 60) == 0 and svc.pool.quarantined_slots == held
        os.kill(child, 9)
        os.waitpid(child, 0)
        assert svc.reap(now + QUARANTINE + 61) == 0
        assert svc.pool.quarantined_slots == 0 and svc.pool.free_slots == 47
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
