"""Prometheus metrics of the frontend; the names are a contract (tests/ops)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from kvserve.metrics import info_labels

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
BAD_MESSAGE_REASONS = ("malformed", "protocol", "invalid", "internal")
DROPPED_OUTPUT_REASONS = ("late", "not_owner")
FINISH_REASONS = ("stop", "length", "abort", "error")
ERROR_CODES = (
    "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNAVAILABLE", "CANCELLED", "DEADLINE_EXCEEDED",
    "UNAUTHENTICATED", "INTERNAL", "NOT_FOUND",
)


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
    bad_messages: Counter = field(init=False)
    dropped_outputs: Counter = field(init=False)
    http_ignored_fields: Counter = field(init=False)
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
            "kvserve_request_errors", "Failed requests by gRPC status code name (HTTP errors under the equivalent name).", ["code"], registry=r
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
        self.bad_messages = Counter(
            "kvserve_frontend_bad_messages",
            "Frames from runners dropped: malformed, protocol (another version), invalid (a "
            "runner speaking for another, too many runners), internal (handling it raised).",
            ["reason"], registry=r,
        )
        for reason in BAD_MESSAGE_REASONS:
            self.bad_messages.labels(reason=reason)
        self.dropped_outputs = Counter(
            "kvserve_frontend_dropped_outputs",
            "Runner outputs not delivered: the attempt was over (late) or another runner owns it.",
            ["reason"], registry=r,
        )
        for reason in DROPPED_OUTPUT_REASONS:
            self.dropped_outputs.labels(reason=reason)
        self.http_ignored_fields = Counter(
            "kvserve_frontend_http_ignored_fields",
            "Request fields the HTTP API accepted and ignored (kvserve does not use them), by "
            "name for vLLM's and SGLang's known fields, else \"other\".",
            ["field"], registry=r,
        )
        self.info = Info("kvserve_frontend", "Frontend build and configuration.", registry=r)

    def set_info(self, **labels: object) -> None:
        """Set the info metric (`kvserve_frontend_info`): model, policy, runners, ...

        `version` defaults to the package version; values are turned into strings.
        """
        self.info.info(info_labels(labels))
