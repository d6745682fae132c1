"""Fixtures: a real `kvserve frontend` process (byte tokenizer) and fake runners for it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvserve.tools.servectl import free_block
from kvserve.v1 import generator_pb2_grpc as pb_grpc

from .fake_runner import FakeRunner


@dataclass
class Frontend:
    proc: subprocess.Popen
    port: int
    zmq_address: str
    runtime: Path
    channel: grpc.Channel
    stub: pb_grpc.GeneratorStub
    health: health_pb2_grpc.HealthStub
    http_port: int = 0  # the OpenAI HTTP face (0 = off)
    metrics_port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def runner(self, runner_id: str, **kw) -> FakeRunner:
        return FakeRunner(self.zmq_address, runner_id, **kw)

    def health_status(self, service: str = "") -> int:
        return self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

    def wait_health(self, status: int, timeout: float = 5.0) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.health_status() == status and self.health_status("kvserve.v1.Generator") == status:
                return True
            time.sleep(0.02)
        return False


def start_frontend(runtime: Path, *extra: str, notify_socket: str | None = None, http: bool = False,
                   metrics: bool = False) -> Frontend:
    """Start a frontend; `http` turns the OpenAI face on (a free port), `metrics` the
    metrics page (a free port)."""
    runtime.mkdir(mode=0o700, parents=True, exist_ok=True)
    http_port, metrics_port = (free_block(1) if http else 0), (free_block(1) if metrics else 0)
    env = dict(os.environ, KVSERVE_RUNTIME_DIR=str(runtime))
    env.pop("NOTIFY_SOCKET", None)
    if notify_socket:
        env["NOTIFY_SOCKET"] = notify_socket
    cmd = [sys.executable, "-m", "kvserve.cli", "frontend", "--tokenizer", "bytes",
           "--port", "0", "--metrics-port", str(metrics_port), "--http-port", str(http_port),
           "--runtime-dir", str(runtime), "--runner-timeout-s", "0.5", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True, env=env)
    line = proc.stdout.readline()
    m = re.search(r"listening on [\d.]+:(\d+), runners connect to (\S+)", line)
    if not m:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"frontend did not start: {line!r}")
    channel = grpc.insecure_channel(f"127.0.0.1:{m.group(1)}")
    if http_port:
        assert proc.stdout.readline().startswith("frontend http on ")
    return Frontend(proc, int(m.group(1)), m.group(2), runtime, channel,
                    pb_grpc.GeneratorStub(channel), health_pb2_grpc.HealthStub(channel), http_port, metrics_port)


def stop_frontend(fe: Frontend) -> int:
    fe.channel.close()
    if fe.proc.poll() is None:
        fe.proc.send_signal(signal.SIGTERM)
    try:
        return fe.proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        fe.proc.kill()
        fe.proc.wait()
        raise
    finally:
        fe.proc.stdout.close()


@pytest.fixture(scope="module")
def frontend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Frontend]:
    fe = start_frontend(tmp_path_factory.mktemp("rt"), "--max-waiting", "4", "--max-new-tokens-cap", "500")
    yield fe
    assert stop_frontend(fe) == 0
    assert list(fe.runtime.iterdir()) == []


@pytest.fixture
def runners(frontend: Frontend) -> Iterator[list[FakeRunner]]:
    """Fake runners created by a test; all are killed (and forgotten by the frontend) after it."""
    made: list[FakeRunner] = []
    yield made
    for r in made:
        r.kill()
    assert frontend.wait_health(health_pb2.HealthCheckResponse.NOT_SERVING)
