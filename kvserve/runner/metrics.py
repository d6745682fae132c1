"""Prometheus metrics of the runner and the frontend, and the HTTP server that exports them.

Each metrics object owns its own `CollectorRegistry` (never the global default one), so
tests and several roles in one process never collide. This module only defines names,
labels and buckets; it knows nothing about scheduling, gRPC or memsvc (memsvc defines its
own metrics in `kvserve.memsvc`). The names are the contract that `ops/prometheus` and
`ops/grafana` are checked against (tests/ops).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server

from kvserve import __version__

# Request latencies: 1 ms up to 10 minutes, dense where interactive serving lives (10 ms-10 s).
LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)
# Gaps between streamed tokens: 1 ms to 10 s; beyond that a stream is stalled anyway.
ITL_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
    0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)
FINISH_REASONS = ("stop", "length", "abort", "error")
ERROR_CODES = (
    "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNAVAILABLE", "CANCELLED", "DEADLINE_EXCEEDED",
    "UNAUTHENTICATED", "INTERNAL",
)

# One scheduler phase (forward pass, memsvc round trip, sampling): 50 us to 30 s.
STEP_BUCKETS: tuple[float, ...] = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
    0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)

RUNNER_PHASES: tuple[str, ...] = ("prefill", "decode", "mixed", "memsvc", "sample")


def _info_labels(labels: dict[str, object]) -> dict[str, str]:
    out = {"version": __version__}
    for key, value in labels.items():
        if not key.isidentifier():
            raise ValueError(f"info label name {key!r} is not a valid identifier")
        out[key] = "" if value is None else str(value)
    return out


@dataclass(slots=True, eq=False)
class RunnerMetrics:
    """Metrics of one runner worker (`kvserve runner`); `registry` holds all of them."""

    registry: CollectorRegistry = field(default_factory=lambda: CollectorRegistry(auto_describe=True))
    step_seconds: Histogram = field(init=False)
    batch_size: Gauge = field(init=False)
    preemptions: Counter = field(init=False)
    memsvc_calls: Counter = field(init=False)
    info: Info = field(init=False)

    def __post_init__(self) -> None:
        r = self.registry
        self.step_seconds = Histogram(
            "kvserve_runner_step_seconds",
            "Time spent in one scheduler step phase (prefill, decode, mixed, memsvc, sample).",
            ["phase"], buckets=STEP_BUCKETS, registry=r,
        )
        self.batch_size = Gauge(
            "kvserve_runner_batch_size", "Requests in the runner's current batch.", registry=r
        )
        self.preemptions = Counter(
            "kvserve_num_preemptions",
            "Requests preempted because the KV pool was exhausted (optimistic policy).",
            registry=r,
        )
        self.memsvc_calls = Counter(
            "kvserve_runner_memsvc_calls", "Step round trips from this runner to memsvc.", registry=r
        )
        self.info = Info("kvserve_runner", "Runner build and configuration.", registry=r)
        for phase in RUNNER_PHASES:
            self.step_seconds.labels(phase=phase)

    def set_info(self, **labels: object) -> None:
        """Set the info metric (`kvserve_runner_info`): model, device, dtype, policy, ...

        `version` defaults to the package version; values are turned into strings.
        """
        self.info.info(_info_labels(labels))


@dataclass(slots=True, eq=False)
class FrontendMetrics:
    """Metrics of the gRPC frontend (`kvserve frontend`); `registry` holds all of them."""

    registry: CollectorRegistry = field(default_factory=lambda: CollectorRegistry(auto_describe=True))
    ttft: Histogram = field(init=False)
    itl: Histogram = field(init=False)
    e2e: Histogram = field(init=False)
    queue_time: Histogram = field(init=False)
    requests: Counter = field(init=False)
    errors: Counter = field(init=False)
    prompt_tokens: Counter = field(init=False)
    generation_tokens: Counter = field(init=False)
    cached_prompt_tokens: Counter = field(init=False)
    running: Gauge = field(init=False)
    waiting: Gauge = field(init=False)
    runners_live: Gauge = field(init=False)
    info: Info = field(init=False)

    def __post_init__(self) -> None:
        r = self.registry
        self.ttft = Histogram(
            "kvserve_time_to_first_token_seconds",
            "From request arrival to the first generated token streamed.",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.itl = Histogram(
            "kvserve_inter_token_latency_seconds",
            "Gap between consecutive generated tokens of one request.",
            buckets=ITL_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "kvserve_e2e_request_latency_seconds",
            "From request arrival to its final message.",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.queue_time = Histogram(
            "kvserve_request_queue_time_seconds",
            "From request arrival until a runner starts its prefill.",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.requests = Counter(
            "kvserve_requests", "Finished requests by finish reason.", ["finish_reason"], registry=r
        )
        self.errors = Counter(
            "kvserve_request_errors", "Failed requests by gRPC status code name.", ["code"], registry=r
        )
        # Export zeros for the expected label values, so that rate() and the alert rules
        # see a series from the first scrape rather than after the first such request.
        for reason in FINISH_REASONS:
            self.requests.labels(finish_reason=reason)
        for code in ERROR_CODES:
            self.errors.labels(code=code)
        self.prompt_tokens = Counter("kvserve_prompt_tokens", "Prompt tokens received.", registry=r)
        self.generation_tokens = Counter(
            "kvserve_generation_tokens", "Tokens generated and streamed.", registry=r
        )
        self.cached_prompt_tokens = Counter(
            "kvserve_cached_prompt_tokens", "Prompt tokens served from the prefix cache.", registry=r
        )
        self.running = Gauge("kvserve_num_requests_running", "Requests being generated.", registry=r)
        self.waiting = Gauge(
            "kvserve_num_requests_waiting", "Requests accepted but not yet running.", registry=r
        )
        self.runners_live = Gauge(
            "kvserve_runners_live", "Runner workers currently connected and alive.", registry=r
        )
        self.info = Info("kvserve_frontend", "Frontend build and configuration.", registry=r)

    def set_info(self, **labels: object) -> None:
        """Set the info metric (`kvserve_frontend_info`): model, policy, runners, ...

        `version` defaults to the package version; values are turned into strings.
        """
        self.info.info(_info_labels(labels))


class MetricsServer(Protocol):
    """What `serve_metrics` returns: the bound `port` (0 when not serving) and `shutdown()`."""

    port: int

    def shutdown(self) -> None: ...


@dataclass(slots=True)
class _NoServer:
    port: int = 0

    def shutdown(self) -> None:
        """Nothing to stop."""


@dataclass(slots=True, eq=False)
class _HttpServer:
    server: object
    thread: threading.Thread
    port: int

    def shutdown(self) -> None:
        """Stop serving, close the listening socket and join the thread."""
        self.server.shutdown()  # type: ignore[attr-defined]
        self.server.server_close()  # type: ignore[attr-defined]
        self.thread.join(timeout=5.0)


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "127.0.0.1") -> MetricsServer:
    """Serve `registry` at http://host:port/metrics from a daemon thread.

    `port == 0` means metrics are off: nothing listens and a no-op object is returned.
    Raises ValueError for a port outside 0..65535 and OSError when it cannot bind.
    """
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ValueError(f"metrics port must be an integer in 0..65535 (0 = off), got {port!r}")
    if port == 0:
        return _NoServer()
    server, thread = start_http_server(port, addr=host, registry=registry)
    return _HttpServer(server=server, thread=thread, port=server.server_address[1])


_SUFFIXES: dict[str, tuple[str, ...]] = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "gauge": ("",),
}


def exported_names(registry: CollectorRegistry) -> set[str]:
    """Every series name `registry` can export (`..._bucket`, `..._total`, `..._info`, ...).

    Derived from the metric families, so labelled metrics that have no child yet count too.
    """
    names: set[str] = set()
    for metric in registry.collect():
        names.update(metric.name + sfx for sfx in _SUFFIXES.get(metric.type, ("",)))
        names.update(s.name for s in metric.samples)
    return names
