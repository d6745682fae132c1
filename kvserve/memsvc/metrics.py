"""Prometheus metrics of one memsvc process, in a registry of its own.

This module knows the metric names and nothing about how the pool works.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

if TYPE_CHECKING:
    from kvserve.memsvc.tiers import Tiers

BAD_MESSAGE_REASONS = ("malformed", "invalid", "internal")
# What kvserve_kv_tier_errors_total{reason} counts (kvserve.memsvc.tiers raises each by name).
DISK_ERROR_REASONS = ("torn", "corrupt", "read", "write", "delete", "mkdir", "queue_full", "internal")

STEP_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 1.0)


class MemsvcMetrics:
    """The `kvserve_*` metrics memsvc exports; `registry` is served on the metrics port."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.slots = Gauge("kvserve_kv_cache_slots", "KV slots by state", ["state"], registry=r)
        # The labelled children, looked up once: set_pool runs after every message.
        self._free, self._request, self._cached = (
            self.slots.labels(state=s) for s in ("free", "request", "cached")
        )
        self.usage = Gauge("kvserve_kv_cache_usage_ratio",
                           "Fraction of KV slots in use and not evictable", registry=r)
        self.queries = Counter("kvserve_prefix_cache_queries",
                               "Prompt tokens looked up in the prefix cache", registry=r)
        self.hits = Counter("kvserve_prefix_cache_hits",
                            "Prompt tokens found in the prefix cache", registry=r)
        self.step_latency = Histogram("kvserve_memsvc_step_latency_seconds",
                                      "Time memsvc spends handling one step message",
                                      buckets=STEP_BUCKETS, registry=r)
        self.clients = Gauge("kvserve_memsvc_clients", "Attached runners (live leases)", registry=r)
        self.reclaimed = Counter("kvserve_memsvc_leases_reclaimed",
                                 "Leases reclaimed after a runner stopped heartbeating or died",
                                 registry=r)
        self.violations = Counter("kvserve_memsvc_invariant_violations",
                                  "Pool invariant violations found (and repaired) by check_integrity",
                                  registry=r)
        self.bad_messages = Counter("kvserve_memsvc_bad_messages",
                                    "Messages and step items refused: malformed (undecodable), invalid "
                                    "(a value out of range, an unknown lease, another protocol), internal "
                                    "(a handler raised; answered, and the pool checked)",
                                    ["reason"], registry=r)
        for reason in BAD_MESSAGE_REASONS:
            self.bad_messages.labels(reason=reason)
        self.kv_event_messages = Counter(
            "kvserve_memsvc_kv_event_messages",
            "KV-event messages for routers: sent on the PUB socket, or dropped above its high-water "
            "mark (still in the replay ring)", ["outcome"], registry=r)
        self.kv_event_blocks = Counter("kvserve_memsvc_kv_event_blocks",
                                       "Blocks announced in KV events, by event type", ["type"], registry=r)
        self.info = Info("kvserve_memsvc", "memsvc build and pool settings", registry=r)
        self.tier_hits = Counter("kvserve_kv_tier_hit_tokens",
                                 "Prompt tokens served from a tier below the pool (copied back into it)",
                                 ["tier"], registry=r)
        self.tier_bytes = Counter("kvserve_kv_tier_bytes",
                                  "KV bytes moved into (direction=in) or out of (out) a tier",
                                  ["tier", "direction"], registry=r)
        self.tier_seconds = Counter("kvserve_kv_tier_seconds",
                                    "Time spent moving KV in and out of a tier (disk: on its worker thread)",
                                    ["tier"], registry=r)
        self.tier_blocks = Gauge("kvserve_kv_tier_blocks", "KV blocks held by a tier", ["tier"], registry=r)
        self.tier_used = Gauge("kvserve_kv_tier_used_bytes", "Bytes held by a tier", ["tier"], registry=r)
        self.tier_errors = Counter("kvserve_kv_tier_errors",
                                   "Disk tier problems: torn or corrupt files dropped, failed writes, reads "
                                   "and deletes, writes dropped on a full queue", ["reason"], registry=r)
        self._queried = 0
        self._hit = 0
        self._tier_seen: dict[tuple, float] = {}

    def set_pool(self, *, free: int, request: int, cached: int, usage: float,
                 queried: int, hit: int) -> None:
        """Refresh the pool gauges and advance the prefix counters to the tree's totals."""
        self._free.set(free)
        self._request.set(request)
        self._cached.set(cached)
        self.usage.set(usage)
        if queried > self._queried:
            self.queries.inc(queried - self._queried)
            self._queried = queried
        if hit > self._hit:
            self.hits.inc(hit - self._hit)
            self._hit = hit

    def _advance(self, counter: Counter, labels: dict[str, str], total: float) -> None:
        key = (id(counter), *labels.values())
        seen = self._tier_seen.get(key, 0)
        if total > seen:
            counter.labels(**labels).inc(total - seen)
            self._tier_seen[key] = total

    def set_tiers(self, tiers: Tiers) -> None:
        """Advance the tier counters to the tiers' totals and set their gauges. The series of
        the configured tiers exist from the first scrape, at 0 (a dashboard's rate() of a series
        that appears only with its first event misses that event)."""
        st = tiers.stats
        configured = [t for t, on in (("host", tiers.host), ("disk", tiers.disk)) if on is not None]
        for tier in configured:
            self.tier_hits.labels(tier=tier)
            self.tier_seconds.labels(tier=tier)
            for direction in ("in", "out"):
                self.tier_bytes.labels(tier=tier, direction=direction)
        if tiers.disk is not None:
            for reason in DISK_ERROR_REASONS:
                self.tier_errors.labels(reason=reason)
        for tier in ("host", "disk"):
            self._advance(self.tier_hits, {"tier": tier}, st.hits[tier])
            self._advance(self.tier_bytes, {"tier": tier, "direction": "in"}, st.bytes_in[tier])
            self._advance(self.tier_bytes, {"tier": tier, "direction": "out"}, st.bytes_out[tier])
            self._advance(self.tier_seconds, {"tier": tier}, st.seconds[tier])
        for reason, n in list(st.errors.items()):
            self._advance(self.tier_errors, {"reason": reason}, n)
        if tiers.host is not None:
            self.tier_blocks.labels(tier="host").set(len(tiers.host.blocks))
            self.tier_used.labels(tier="host").set(tiers.host.bytes)
        if tiers.disk is not None:
            self.tier_blocks.labels(tier="disk").set(len(tiers.disk))
            self.tier_used.labels(tier="disk").set(tiers.disk.bytes)
