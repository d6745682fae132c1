"""A runner that speaks another protocol version is refused by a real frontend process:
logged with both versions, counted in kvserve_frontend_bad_messages_total{reason="protocol"},
never routed to; so is a version 1 runner, whose Hello has another shape; a runner of this
version still is."""

from __future__ import annotations

import os
import re
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import zmq
from grpc_health.v1 import health_pb2

from kvserve.messages.frontend_runner import PROTOCOL_VERSION, UP, Hello, RunnerStatus
from kvserve.tools.servectl import free_block
from kvserve.v1 import generator_pb2 as pb

from ..messages.test_links import V1_FRAMES
from .conftest import start_frontend, stop_frontend

pytestmark = pytest.mark.timeout(60)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def test_runner_of_another_protocol_version_is_refused(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    # Started inside the test, so that capfd holds the frontend's stderr (its log).
    metrics = free_block(1)
    fe = start_frontend(tmp_path / "rt", "--metrics-port", str(metrics))
    ctx = zmq.Context()
    sock, old = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    for s, name in ((sock, b"r-future"), (old, b"r-old")):
        s.setsockopt(zmq.IDENTITY, name)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(fe.zmq_address)
    good = None
    try:
        future = PROTOCOL_VERSION + 1
        sock.send(UP.encode(Hello(runner_id="r-future", pid=os.getpid(), max_context_len=64,
                                  protocol=future)))
        old.send(V1_FRAMES[1][1])  # a version 1 runner's Hello, byte for byte
        end = time.monotonic() + 1.0
        while time.monotonic() < end:  # a live, chatty runner: only its version is wrong
            sock.send(UP.encode(RunnerStatus(runner_id="r-future", running=0, waiting=0, kv_usage=0.0)))
            assert fe.health_status() == NOT_SERVING
            time.sleep(0.1)
        with pytest.raises(grpc.RpcError) as info:
            list(fe.stub.Generate(pb.GenerateRequest(text="hi"), timeout=5))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE

        good = fe.runner("r-now")
        assert fe.wait_health(SERVING)
        msgs = list(fe.stub.Generate(pb.GenerateRequest(text="hi"), timeout=10))
        assert msgs[-1].finish_reason == "stop" and len(good.generate_reqs()) == 1
        page = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5).read().decode()
        refused = re.search(r'^kvserve_frontend_bad_messages_total\{reason="protocol"\} (\S+)$', page, re.M)
        assert refused and float(refused.group(1)) == 2.0, page[-2000:]
    finally:
        sock.close(0)
        old.close(0)
        ctx.term()
        if good is not None:
            good.kill()
        assert stop_frontend(fe) == 0
    log = capfd.readouterr().err
    assert (f"runner r-future refused: it speaks protocol version {future}, "
            f"this frontend speaks {PROTOCOL_VERSION}") in log
    assert f"runner r-old refused: it speaks protocol version 1, this frontend speaks {PROTOCOL_VERSION}" in log
    assert "runner r-now" in log and "connected" in log
