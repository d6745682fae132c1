"""The memsvc message handlers: one frame in, one frame out, plus lease reaping.

`MemsvcService` owns the storage, the `Pool` and the leases; `handle(frame)` decodes a
request, applies it and returns the encoded reply (an `ErrorReply` naming the problem
for anything malformed or invalid, with no state change). It never raises: a handler that
raises anyway (a bug, or an input no check foresaw) is answered with an `ErrorReply`,
counted as reason "internal", and the pool's invariants are checked and repaired at once.

This module knows nothing about ZMQ sockets, signals or the command line.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvserve import __version__
from kvserve.memsvc.integrity import check_integrity
from kvserve.memsvc.kv_events import BlockEvents
from kvserve.memsvc.metrics import MemsvcMetrics
from kvserve.memsvc.policy import make_policy
from kvserve.memsvc.pool import ItemError, Pool
from kvserve.memsvc.shape import PoolShape
from kvserve.memsvc.storage import KVStorage, ReqToTokenPool
from kvserve.memsvc.tiers import Tiers, TierSettings
from kvserve.messages.runner_memsvc import (
    PROTOCOL_VERSION,
    REPLIES,
    REQUESTS,
    Attach,
    AttachReply,
    Detach,
    DetachReply,
    ErrorReply,
    Heartbeat,
    HeartbeatReply,
    Layout,
    Stats,
    StatsReply,
    Step,
    StepReply,
)
from kvserve.procs import pid_alive
from kvserve.wire import WireError

log = logging.getLogger("kvserve.memsvc")

MAX_PID = 1 << 22  # Linux's largest pid_max
MAX_NAME = 256
# The longest an expired local lease's slots wait for its stalled process to exit or attach
# again (a runner stopped for longer is taken for lost).
STALLED_QUARANTINE_MAX_S = 600.0


@dataclass(slots=True)
class Lease:
    """One attached client."""

    lease: int
    name: str
    pid: int
    local: bool
    last_seen: float


class MemsvcService:
    """Pool state, leases and the handlers of every request type."""

    def __init__(self, shape: PoolShape, *, policy: str, grow_chunk: int, device: str,
                 lease_timeout_s: float, lease_grace_s: float = 0.5,
                 reclaim_quarantine_s: float = 2.0, local_pids: bool = True,
                 kv_event_block_size: int = 0, tiers: TierSettings | None = None) -> None:
        self.layout = Layout(
            n_layers=shape.n_layers, n_kv_heads=shape.n_kv_heads, head_dim=shape.head_dim,
            dtype=shape.dtype, size=shape.size, page_size=shape.page_size,
            max_reqs=shape.max_reqs, max_context_len=shape.max_context_len, device=device,
            policy=policy, grow_chunk=grow_chunk,
        )
        self.kv = KVStorage(n_layers=shape.n_layers, size=shape.size, n_kv_heads=shape.n_kv_heads,
                            head_dim=shape.head_dim, dtype=shape.dtype, device=device)
        self.table = ReqToTokenPool(max_reqs=shape.max_reqs, max_context_len=shape.max_context_len,
                                    device=device)
        # the KV events routers read (None: not published)
        self.events = BlockEvents(kv_event_block_size) if kv_event_block_size else None
        # the host and disk tiers below the pool (None: off)
        self.tiers = None
        if tiers is not None and tiers.enabled:
            try:
                self.tiers = Tiers.create(self.kv.k_buffer, self.kv.v_buffer, tiers)
                self.tiers.tell(self.events)  # their blocks in the KV events (None: not published)
            except BaseException:
                self.kv.close()
                self.table.close()
                raise
        self.pool = Pool(size=shape.size, page_size=shape.page_size, max_reqs=shape.max_reqs,
                         max_context_len=shape.max_context_len,
                         policy=make_policy(policy, grow_chunk), req_to_token=self.table.req_to_token,
                         listener=self.events, tiers=self.tiers)
        self.metrics = MemsvcMetrics()
        self.metrics.info.info({"version": __version__, "policy": policy, "device": device,
                                "page_size": str(shape.page_size), "slots": str(shape.size)})
        self.lease_timeout_s = lease_timeout_s
        self.lease_grace_s = lease_grace_s
        self.reclaim_quarantine_s = reclaim_quarantine_s
        self.local_pids = local_pids
        self.leases: dict[int, Lease] = {}
        self.max_leases = 4 * shape.max_reqs  # a client that attaches in a loop cannot grow this map
        self.reclaimed = 0
        self.violations = 0
        self.bad_messages = 0
        self._cuda = torch.device(device).type == "cuda"
        self._host = socket.gethostname()
        self._handlers: dict[type, Callable[[Any], Any]] = {
            Attach: self._attach, Step: self._step, Heartbeat: self._heartbeat,
            Detach: self._detach, Stats: self._stats,
        }
        self.refresh_metrics()

    # ---- entry points ---------------------------------------------------------
    def handle(self, frame: bytes) -> bytes:
        """Decode, apply and answer one request frame (never raises)."""
        try:
            msg = REQUESTS.decode(frame)
        except WireError as exc:
            return self.bad(f"bad message: {exc}")
        start = time.perf_counter()
        try:
            reply = self._handlers[type(msg)](msg)
        except Exception as exc:  # noqa: BLE001 - the process must outlive any frame
            log.exception("memsvc: %s handler raised", type(msg).__name__)
            reply = ErrorReply(f"{type(msg).__name__}: internal error: {type(exc).__name__}: {exc}")
            self._count_bad(reply.error, reason="internal")
            self.check()  # a handler stopped half-way: repair what it left
        else:
            if isinstance(reply, ErrorReply):
                self._count_bad(reply.error, reason="invalid")
        if isinstance(msg, Step):
            self.metrics.step_latency.observe(time.perf_counter() - start)
        self.refresh_metrics()
        return REPLIES.encode(reply)

    def bad(self, error: str) -> bytes:
        """Count a malformed message and return the encoded ErrorReply."""
        self._count_bad(error, reason="malformed")
        return REPLIES.encode(ErrorReply(error))

    def _count_bad(self, error: str, n: int = 1, *, reason: str) -> None:
        self.bad_messages += n
        self.metrics.bad_messages.labels(reason=reason).inc(n)
        log.warning("memsvc: %s", error[:500])

    def reap(self, now: float | None = None) -> int:
        """Reclaim leases whose local pid is gone (at once) or that expired: silent for their
        TTL plus the grace. An expired lease's runner may only be stalled, in the middle of a
        step, so its rows and private slots stay quarantined (docs/interfaces.md, "Lease
        fencing"): a local process's until it exits or attaches again (then its stalled step
        is over), at most `STALLED_QUARANTINE_MAX_S`; a remote one's for
        `reclaim_quarantine_s`. A dead process writes nothing, so its slots are free at once.
        Also returns quarantined slots whose time has come. Returns the leases reclaimed."""
        now = time.monotonic() if now is None else now
        watch = self.local_pids
        released = self.pool.release_quarantine(now, (lambda pid: not pid_alive(pid)) if watch else None)
        expire = self.lease_timeout_s + self.lease_grace_s
        gone = []
        for lease in self.leases.values():
            if lease.local and watch and not pid_alive(lease.pid):
                gone.append((lease, None))
            elif now - lease.last_seen > expire:
                gone.append((lease, now + self.reclaim_quarantine_s))
        for lease, until in gone:
            watched = lease.local and watch and until is not None
            if watched:
                until = now + max(self.reclaim_quarantine_s, STALLED_QUARANTINE_MAX_S)
            rows = self.pool.drop_lease(lease.lease, quarantine_until=until,
                                        pid=lease.pid if watched else 0)
            del self.leases[lease.lease]
            self.reclaimed += 1
            self.metrics.reclaimed.inc()
            why = "its process is gone" if until is None else (
                f"silent for {now - lease.last_seen:.1f} s; its slots are quarantined until pid {lease.pid} "
                f"exits or attaches again (at most {until - now:g} s)" if watched else
                f"silent for {now - lease.last_seen:.1f} s; its slots are quarantined for "
                f"{self.reclaim_quarantine_s:g} s")
            log.warning("memsvc: reclaimed lease of %s (pid %d), %s: %d rows", lease.name, lease.pid,
                        why, rows)
        if gone or released:
            self.refresh_metrics()
        return len(gone)

    def check(self) -> list[str]:
        """check_integrity with logging, counting and repair."""
        problems = check_integrity(self.pool, repair=True)
        for text in problems:
            log.error("memsvc: invariant violation (repaired where possible): %s", text)
        if problems:
            self.violations += len(problems)
            self.metrics.violations.inc(len(problems))
            self.refresh_metrics()
        return problems

    def refresh_metrics(self) -> None:
        p = self.pool
        self.metrics.set_pool(free=p.free_slots, request=p.request_slots, cached=p.cached_slots,
                              usage=p.kv_usage(), queried=p.tree.queried_tokens, hit=p.tree.hit_tokens)
        self.metrics.clients.set(len(self.leases))
        if self.tiers is not None:
            self.metrics.set_tiers(self.tiers)

    def poll_tiers(self) -> None:
        """Hand the disk tier's finished writes and deletions to the KV events."""
        if self.tiers is not None:
            self.tiers.poll_events()

    def close(self) -> None:
        if self.tiers is not None:
            self.tiers.close()  # the queued disk writes first
        self.kv.close()
        self.table.close()

    # ---- handlers ---------------------------------------------------------------
    def _lease(self, lease_id: int) -> Lease | None:
        lease = self.leases.get(lease_id)
        if lease is not None:
            lease.last_seen = time.monotonic()
        return lease

    def _unknown(self, lease_id: int) -> ErrorReply:
        return ErrorReply(f"lease {lease_id}: unknown lease (expired, detached or never attached); re-attach")

    def _attach(self, msg: Attach) -> AttachReply | ErrorReply:
        if msg.protocol != PROTOCOL_VERSION:
            return ErrorReply(f"attach: protocol version {msg.protocol} != memsvc's {PROTOCOL_VERSION}: "
                              "run a runner and a memsvc of the same kvserve release")
        mine = self.layout
        wrong = [f"{name} {got!r} != pool's {want!r}" for name, got, want in (
            ("n_layers", msg.n_layers, mine.n_layers), ("n_kv_heads", msg.n_kv_heads, mine.n_kv_heads),
            ("head_dim", msg.head_dim, mine.head_dim), ("dtype", msg.dtype, mine.dtype)) if got != want]
        if wrong:
            return ErrorReply("attach: layout mismatch: " + ", ".join(wrong))
        if not 0 <= msg.pid <= MAX_PID:
            return ErrorReply(f"attach: pid {msg.pid} is not a process id (0..{MAX_PID})")
        if len(msg.name) > MAX_NAME or len(msg.host) > MAX_NAME:
            return ErrorReply(f"attach: name and host must be at most {MAX_NAME} characters")
        if len(self.leases) >= self.max_leases:
            return ErrorReply(f"attach: {len(self.leases)} leases held, the most memsvc keeps")
        lease_id = secrets.randbits(62)
        local = msg.host == self._host and msg.pid > 0
        if local and self.pool.release_quarantine(time.monotonic(), lambda pid: pid == msg.pid):
            # the process asks again from its loop: the step it was stalled in is over
            log.info("memsvc: %s (pid %d) attached again: its quarantined slots are free", msg.name, msg.pid)
            self.refresh_metrics()
        self.leases[lease_id] = Lease(lease_id, msg.name, msg.pid, local, time.monotonic())
        log.info("memsvc: attached %s (pid %d) lease %d", msg.name, msg.pid, lease_id)
        return AttachReply(lease=lease_id, layout=mine,
                           buffers=self.kv.handles() + self.table.handles(),
                           kv_usage=self.pool.kv_usage(), memsvc_pid=os.getpid() if local else 0,
                           lease_ttl_s=self.lease_timeout_s)

    def _step(self, msg: Step) -> StepReply | ErrorReply:
        if self._lease(msg.lease) is None:
            return self._unknown(msg.lease)
        most = 2 * self.layout.max_reqs
        for name, items in (("admit", msg.admit), ("grow", msg.grow), ("commit", msg.commit),
                            ("release", msg.release)):
            if len(items) > most:
                return ErrorReply(f"step: {len(items)} {name} items; at most {most} "
                                  "(twice the pool's rows) in one step")
        pool, errors = self.pool, []

        def apply(items: list, handler: Callable) -> list:
            # A bad item becomes an error string; the other items of the step still apply.
            results = []
            for item in items:
                try:
                    results.append(handler(msg.lease, item))
                except ItemError as exc:
                    errors.append(str(exc))
            return results

        apply(msg.release, pool.release)
        apply(msg.commit, pool.commit)
        grown = apply(msg.grow, pool.grow)
        admitted = apply(msg.admit, pool.admit)
        if errors:
            self._count_bad("; ".join(errors), len(errors), reason="invalid")
        if self._cuda:
            torch.cuda.synchronize()
        return StepReply(admitted=admitted, grown=grown, errors=errors, kv_usage=pool.kv_usage())

    def _heartbeat(self, msg: Heartbeat) -> HeartbeatReply | ErrorReply:
        if self._lease(msg.lease) is None:
            return self._unknown(msg.lease)
        return HeartbeatReply(kv_usage=self.pool.kv_usage())

    def _detach(self, msg: Detach) -> DetachReply | ErrorReply:
        lease = self.leases.pop(msg.lease, None)
        if lease is None:
            return self._unknown(msg.lease)
        log.info("memsvc: detached %s (pid %d)", lease.name, lease.pid)
        return DetachReply(rows_released=self.pool.drop_lease(msg.lease))

    def _stats(self, msg: Stats) -> StatsReply:
        p = self.pool
        return StatsReply(
            policy=self.layout.policy, slots_total=p.allocator.usable_slots,
            slots_free=p.free_slots, slots_request=p.request_slots, slots_cached=p.cached_slots,
            slots_evictable=p.tree.evictable_size, rows_used=len(p.rows),
            clients=len(self.leases), leases=[lease.name for lease in self.leases.values()],
            leases_reclaimed=self.reclaimed, invariant_violations=self.violations,
            bad_messages=self.bad_messages, prefix_queried_tokens=p.tree.queried_tokens,
            prefix_hit_tokens=p.tree.hit_tokens, kv_usage=p.kv_usage(),
            slots_quarantined=p.quarantined_slots,
        )
