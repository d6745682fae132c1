"""Prometheus metrics of one runner worker; the names are a contract (tests/ops)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from kvserve.metrics import info_labels

# One scheduler phase (forward pass, memsvc round trip, sampling): 50 us to 30 s.
STEP_BUCKETS: tuple[float, ...] = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
    0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)

RUNNER_PHASES: tuple[str, ...] = ("prefill", "decode", "mixed", "memsvc", "sample", "mask")
"""`mask`: a step's grammar masks, on their own thread while the forward runs (structured outputs)."""



@dataclass(slots=True, eq=False)
class RunnerMetrics:
    """Metrics of one runner worker (`kvserve runner`); `registry` holds all of them."""

    registry: CollectorRegistry = field(default_factory=lambda: CollectorRegistry(auto_describe=True))
    step_seconds: Histogram = field(init=False)
    batch_size: Gauge = field(init=False)
    preemptions: Counter = field(init=False)
    memsvc_calls: Counter = field(init=False)
    bad_messages: Counter = field(init=False)
    undelivered: Counter = field(init=False)
    nonfinite_logits: Counter = field(init=False)
    masked_rows: Counter = field(init=False)
    info: Info = field(init=False)

    def __post_init__(self) -> None:
        r = self.registry
        self.step_seconds = Histogram(
            "kvserve_runner_step_seconds",
            "Time spent in one scheduler step phase (prefill, decode, mixed, memsvc, sample; mask: the "
            "grammar masks of the step's constrained rows, computed while the forward runs).",
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
        self.bad_messages = Counter(
            "kvserve_runner_bad_messages",
            "Frames from the frontend dropped: malformed (undecodable), internal (taking it raised; "
            "the request failed).", ["reason"], registry=r,
        )
        for reason in ("malformed", "internal"):
            self.bad_messages.labels(reason=reason)
        self.undelivered = Counter(
            "kvserve_runner_undelivered_outputs",
            "Token batches the frontend could not take within the send timeout; their "
            "requests were aborted here.", registry=r,
        )
        self.nonfinite_logits = Counter(
            "kvserve_runner_nonfinite_logits",
            "Requests failed (INTERNAL) because the model's logits for them held NaN or inf.",
            registry=r,
        )
        self.masked_rows = Counter(
            "kvserve_runner_masked_rows",
            "Rows whose grammar mask was computed (one per constrained request per sampled token).",
            registry=r,
        )
        self.info = Info("kvserve_runner", "Runner build and configuration.", registry=r)
        for phase in RUNNER_PHASES:
            self.step_seconds.labels(phase=phase)

    def set_info(self, **labels: object) -> None:
        """Set the info metric (`kvserve_runner_info`): model, device, dtype, policy, ...

        `version` defaults to the package version; values are turned into strings.
        """
        self.info.info(info_labels(labels))
