"""Unit tests of the runner's and the frontend's metrics and of kvserve/metrics.py: names,
labels, isolation, the HTTP server."""

from __future__ import annotations

import socket
import urllib.request

import pytest

from kvserve import __version__
from kvserve.frontend.metrics import LATENCY_BUCKETS, FrontendMetrics
from kvserve.metrics import exported_names, serve_metrics
from kvserve.runner.metrics import RUNNER_PHASES, RunnerMetrics


def _value(registry, name: str, labels: dict[str, str] | None = None) -> float | None:
    return registry.get_sample_value(name, labels or {})


def test_runner_metric_names_and_labels() -> None:
    m = RunnerMetrics()
    m.step_seconds.labels(phase="decode").observe(0.01)
    m.batch_size.set(7)
    m.preemptions.inc()
    m.memsvc_calls.inc(3)
    m.set_info(model="smol", device="cpu", dtype="float32", policy="reserve")
    r = m.registry
    assert _value(r, "kvserve_runner_step_seconds_count", {"phase": "decode"}) == 1
    assert _value(r, "kvserve_runner_step_seconds_count", {"phase": "prefill"}) == 0
    assert _value(r, "kvserve_runner_batch_size") == 7
    assert _value(r, "kvserve_num_preemptions_total") == 1
    assert _value(r, "kvserve_runner_memsvc_calls_total") == 3
    info = {"version": __version__, "model": "smol", "device": "cpu", "dtype": "float32",
            "policy": "reserve"}
    assert _value(r, "kvserve_runner_info", info) == 1
    # every phase is pre-created so dashboards show zeros, not gaps
    for phase in RUNNER_PHASES:
        assert _value(r, "kvserve_runner_step_seconds_count", {"phase": phase}) is not None


def test_frontend_metric_names_and_labels() -> None:
    f = FrontendMetrics()
    for hist in (f.ttft, f.itl, f.e2e, f.queue_time):
        hist.observe(0.05)
    f.requests.labels(finish_reason="stop").inc()
    f.errors.labels(code="INVALID_ARGUMENT").inc(2)
    f.prompt_tokens.inc(10)
    f.generation_tokens.inc(4)
    f.cached_prompt_tokens.inc(8)
    f.running.set(2)
    f.waiting.set(1)
    f.runners_live.set(1)
    f.set_info(model="smol", policy="reserve")
    r = f.registry
    for name in ("kvserve_time_to_first_token_seconds", "kvserve_inter_token_latency_seconds",
                 "kvserve_e2e_request_latency_seconds", "kvserve_request_queue_time_seconds"):
        assert _value(r, f"{name}_count") == 1, name
    assert _value(r, "kvserve_requests_total", {"finish_reason": "stop"}) == 1
    assert _value(r, "kvserve_request_errors_total", {"code": "INVALID_ARGUMENT"}) == 2
    assert _value(r, "kvserve_prompt_tokens_total") == 10
    assert _value(r, "kvserve_generation_tokens_total") == 4
    assert _value(r, "kvserve_cached_prompt_tokens_total") == 8
    assert _value(r, "kvserve_num_requests_running") == 2
    assert _value(r, "kvserve_num_requests_waiting") == 1
    assert _value(r, "kvserve_runners_live") == 1
    assert _value(r, "kvserve_frontend_info",
                  {"version": __version__, "model": "smol", "policy": "reserve"}) == 1


def test_latency_buckets_span_ms_to_minutes() -> None:
    assert LATENCY_BUCKETS[0] == pytest.approx(0.001)
    assert LATENCY_BUCKETS[-1] >= 300
    assert list(LATENCY_BUCKETS) == sorted(LATENCY_BUCKETS)
    f = FrontendMetrics()
    f.ttft.observe(0.0005)
    f.ttft.observe(200.0)
    assert _value(f.registry, "kvserve_time_to_first_token_seconds_bucket", {"le": "0.001"}) == 1
    assert _value(f.registry, "kvserve_time_to_first_token_seconds_bucket", {"le": "300.0"}) == 2


def test_registries_are_independent() -> None:
    a, b = FrontendMetrics(), FrontendMetrics()
    a.prompt_tokens.inc(5)
    assert _value(b.registry, "kvserve_prompt_tokens_total") == 0
    RunnerMetrics(), RunnerMetrics()  # a second instance must not clash on names


def test_exported_names_include_unused_labelled_series() -> None:
    names = exported_names(FrontendMetrics().registry)
    assert "kvserve_requests_total" in names
    assert "kvserve_time_to_first_token_seconds_bucket" in names
    assert "kvserve_frontend_info" in names
    assert "kvserve_requests" not in names


def test_bad_info_label_is_refused() -> None:
    with pytest.raises(ValueError, match="not a valid identifier"):
        RunnerMetrics().set_info(**{"bad-name": "x"})


@pytest.mark.timeout(20)
def test_serve_metrics_over_http_and_shutdown() -> None:
    f = FrontendMetrics()
    f.generation_tokens.inc(42)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = serve_metrics(f.registry, port)
    try:
        assert server.port == port
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        assert b"kvserve_generation_tokens_total 42.0" in body
        assert b"# TYPE kvserve_time_to_first_token_seconds histogram" in body
    finally:
        server.shutdown()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_serve_metrics_port_zero_is_off_and_bad_port_refused() -> None:
    server = serve_metrics(RunnerMetrics().registry, 0)
    assert server.port == 0
    server.shutdown()
    with pytest.raises(ValueError, match="metrics port"):
        serve_metrics(RunnerMetrics().registry, 70000)
    with pytest.raises(ValueError, match="metrics port"):
        serve_metrics(RunnerMetrics().registry, -1)
