"""Live checks of a real `kvserve serve` (embedded default model, CPU): metrics, Prometheus,
sd_notify and the exit status when a worker dies.

One service runs for the module. It gets a real Unix datagram socket as NOTIFY_SOCKET and
WATCHDOG_USEC, so the test sees what systemd would see. The last test stops it with
SIGTERM. Everything runs in a tmp runtime dir and on free loopback ports.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.faults.harness import children_of, free_block, stop_process

from .opsfiles import PROM_DIR, dashboard_exprs, promql_metric_names

_PARTS = ("kvserve.serve.main", "kvserve.runner.main", "kvserve.frontend.main",
          "kvserve.memsvc.server")
_MISSING = [m for m in _PARTS if importlib.util.find_spec(m) is None]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(_MISSING), reason=f"`kvserve serve` cannot run yet: {', '.join(_MISSING)} "
                       "not written"),
]

READY_TIMEOUT_S = 240.0


@dataclass
class Notifications:
    """Datagrams received on NOTIFY_SOCKET: (monotonic time, sender pid, message)."""

    sock: socket.socket
    got: list[tuple[float, int, str]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        self.sock.settimeout(0.2)
        creds = struct.calcsize("3i")
        while not self.stop.is_set():
            try:
                data, anc, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(creds))
            except TimeoutError:
                continue
            except OSError:
                return
            pid = -1
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid = struct.unpack("3i", payload[:creds])[0]
            for line in data.decode().splitlines():
                self.got.append((time.monotonic(), pid, line))

    def wait_for(self, message: str, timeout: float) -> tuple[float, int, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for item in self.got:
                if item[2] == message:
                    return item
            time.sleep(0.05)
        raise AssertionError(f"no {message} within {timeout}s; got {[m for _, _, m in self.got]}")


@dataclass
class Service:
    proc: subprocess.Popen
    grpc_port: int
    metrics_port: int
    runtime: Path
    notes: Notifications
    ready_at: float = 0.0
    log: Path | None = None


def _start(tmp: Path, extra: list[str]) -> Service:
    runtime = tmp / "run"
    runtime.mkdir(mode=0o700)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp / "notify.sock"))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    notes = Notifications(sock)
    threading.Thread(target=notes.run, daemon=True).start()
    base = free_block(6)
    env = dict(os.environ, KVSERVE_RUNTIME_DIR=str(runtime), NOTIFY_SOCKET=str(tmp / "notify.sock"),
               WATCHDOG_USEC="1000000", PYTHONUNBUFFERED="1")
    env.pop("WATCHDOG_PID", None)
    log = tmp / "serve.log"
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--device", "cpu",
           "--port", str(base), "--metrics-port", str(base + 1), "--kv-tokens", "4096", *extra]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return Service(proc, base, base + 1, runtime, notes, log=log)


def _stop(svc: Service) -> None:
    if svc.proc.poll() is None:
        svc.proc.send_signal(signal.SIGTERM)
        try:
            svc.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(svc.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    svc.proc.wait(timeout=10)
    svc.notes.stop.set()
    svc.notes.sock.close()


def _log(svc: Service) -> str:
    return svc.log.read_text(errors="replace")[-4000:] if svc.log else ""


def _wait_ready(svc: Service) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if any(m == "READY=1" for _, _, m in svc.notes.got):
            svc.ready_at = time.monotonic()
            return
        if svc.proc.poll() is not None:
            raise AssertionError(f"kvserve serve exited {svc.proc.returncode}:\n{_log(svc)}")
        time.sleep(0.1)
    raise AssertionError(f"no READY=1 within {READY_TIMEOUT_S}s:\n{_log(svc)}")


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> Iterator[Service]:
    tmp = tmp_path_factory.mktemp("serve")
    # Both KV tiers on, so every panel of the dashboard has its series to read.
    svc = _start(tmp, ["--host-cache-bytes", "64MiB", "--disk-cache-dir", str(tmp / "kv-disk")])
    try:
        _wait_ready(svc)
        yield svc
    finally:
        _stop(svc)


def _stub(port: int):
    import grpc

    from kvserve.v1 import generator_pb2_grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    return channel, generator_pb2_grpc.GeneratorStub(channel)


def _generate(port: int, n: int, max_new_tokens: int = 6) -> list[str]:
    from kvserve.v1 import generator_pb2 as pb

    channel, stub = _stub(port)
    reasons = []
    try:
        for i in range(n):
            req = pb.GenerateRequest(text=f"The capital of France is {i}",
                                     sampling=pb.SamplingParams(max_new_tokens=max_new_tokens,
                                                                temperature=0.0))
            finish = [m.finish_reason for m in stub.Generate(req, timeout=60) if m.finish_reason]
            reasons.append(finish[-1] if finish else "")
    finally:
        channel.close()
    return reasons


def _scrape(port: int) -> dict[tuple[str, frozenset], float]:
    from prometheus_client.parser import text_string_to_metric_families

    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(body) for s in fam.samples}


def _scrape_all(svc: Service) -> dict[tuple[str, frozenset], float]:
    out: dict[tuple[str, frozenset], float] = {}
    for port in (svc.metrics_port, svc.metrics_port + 1, svc.metrics_port + 2):
        out.update(_scrape(port))
    return out


def _total(samples: dict, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


@pytest.mark.timeout(READY_TIMEOUT_S + 60)
def test_ready_only_when_grpc_answers_and_watchdog_follows(service: Service) -> None:
    from kvserve.v1 import generator_pb2 as pb

    _, pid, _ = service.notes.wait_for("READY=1", 1)
    assert pid == service.proc.pid, "READY=1 must come from the main process (NotifyAccess=main)"
    channel, stub = _stub(service.grpc_port)
    try:
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=2)
    finally:
        channel.close()
    assert info.vocab_size > 0
    time.sleep(1.6)
    watchdogs = [(t, p) for t, p, m in service.notes.got if m == "WATCHDOG=1" and t >= service.ready_at - 1]
    assert len(watchdogs) >= 2, service.notes.got
    assert all(p == service.proc.pid for _, p in watchdogs)
    assert not any(m == "READY=1" and p != service.proc.pid for _, p, m in service.notes.got)


@pytest.mark.timeout(READY_TIMEOUT_S + 120)
def test_metrics_exist_and_counters_move(service: Service) -> None:
    before = _scrape_all(service)
    names = {n for n, _ in before}
    used = {n for _, e in dashboard_exprs() for n in promql_metric_names(e)}
    import yaml

    for group in yaml.safe_load((PROM_DIR / "alerts.yml").read_text())["groups"]:
        for rule in group["rules"]:
            used |= promql_metric_names(rule["expr"])
    assert not used - names, f"dashboard/alert names the live service does not export: {used - names}"
    for info in ("kvserve_frontend_info", "kvserve_memsvc_info", "kvserve_runner_info"):
        labels = [dict(lbl) for (n, lbl) in before if n == info]
        assert labels and "version" in labels[0], info
    runner_info = [dict(lbl) for (n, lbl) in before if n == "kvserve_runner_info"][0]
    assert {"model", "device", "policy"} <= set(runner_info), runner_info

    reasons = _generate(service.grpc_port, 3)
    assert len(reasons) == 3 and all(reasons), reasons
    after = _scrape_all(service)
    moved = {
        "kvserve_requests_total": 3,
        "kvserve_time_to_first_token_seconds_count": 3,
        "kvserve_e2e_request_latency_seconds_count": 3,
        "kvserve_prompt_tokens_total": 3,
        "kvserve_generation_tokens_total": 3,
        "kvserve_runner_step_seconds_count": 1,
        "kvserve_runner_memsvc_calls_total": 1,
        "kvserve_memsvc_step_latency_seconds_count": 1,
        "kvserve_prefix_cache_queries_total": 1,
    }
    for name, at_least in moved.items():
        delta = _total(after, name) - _total(before, name)
        assert delta >= at_least, f"{name} moved by {delta}, expected >= {at_least}"
    assert _total(after, "kvserve_inter_token_latency_seconds_count") > _total(
        before, "kvserve_inter_token_latency_seconds_count")


@pytest.mark.timeout(READY_TIMEOUT_S + 120)
def test_real_prometheus_scrapes_the_service(service: Service, tmp_path: Path) -> None:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("the `prometheus` server is not installed (Debian package `prometheus`)")
    port = free_block(1)
    m = service.metrics_port
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(json.dumps({
        "global": {"scrape_interval": "1s", "scrape_timeout": "900ms"},
        "scrape_configs": [
            {"job_name": "kvserve-frontend", "static_configs": [{"targets": [f"127.0.0.1:{m}"]}]},
            {"job_name": "kvserve-memsvc", "static_configs": [{"targets": [f"127.0.0.1:{m + 1}"]}]},
            {"job_name": "kvserve-runner", "static_configs": [{"targets": [f"127.0.0.1:{m + 2}"]}]},
        ],
    }))
    with open(tmp_path / "prometheus.log", "wb") as prom_log:
        prom = subprocess.Popen(
            [binary, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=prom_log, start_new_session=True)
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            _generate(service.grpc_port, 1, max_new_tokens=4)

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    try:
        def query(q: str) -> list[dict]:
            url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": q})
            return json.load(urllib.request.urlopen(url, timeout=5))["data"]["result"]

        deadline = time.monotonic() + 60
        ttft: list[dict] = []
        up: list[dict] = []
        while time.monotonic() < deadline:
            try:
                ttft = query("sum(kvserve_time_to_first_token_seconds_count)")
                up = query('up{job=~"kvserve-.*"} == 1')
            except OSError:
                ttft, up = [], []
            if ttft and float(ttft[0]["value"][1]) > 0 and len(up) == 3:
                break
            time.sleep(0.5)
        assert ttft and float(ttft[0]["value"][1]) > 0, ttft
        assert len(up) == 3, up
    finally:
        stop.set()
        worker.join(timeout=90)
        stop_process(prom)


@pytest.mark.timeout(120)
def test_sigterm_sends_stopping_and_cleans_up(service: Service) -> None:
    """Last test of the module: it stops the shared service."""
    service.proc.send_signal(signal.SIGTERM)
    code = service.proc.wait(timeout=60)
    service.notes.wait_for("STOPPING=1", 2)
    assert code == 0, _log(service)
    assert not [p for p in service.runtime.iterdir() if p.is_socket()], list(service.runtime.iterdir())


@pytest.mark.timeout(READY_TIMEOUT_S + 90)
def test_worker_death_makes_serve_exit_nonzero(tmp_path: Path) -> None:
    svc = _start(tmp_path, ["--max-restarts", "0"])
    try:
        _wait_ready(svc)
        kids = children_of(svc.proc.pid)
        runners = [pid for pid, cmd in kids.items() if " runner" in cmd]
        assert runners, f"no runner child among {kids}"
        os.kill(runners[0], signal.SIGKILL)
        code = svc.proc.wait(timeout=60)
        assert code != 0, _log(svc)
    finally:
        _stop(svc)
