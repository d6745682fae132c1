"""A runner that speaks another protocol version is refused by a real frontend process:
logged with both versions, counted, never routed to; a runner of this version still is."""

from __future__ import annotations

import os
import time
from pathlib import Path

import grpc
import pytest
import zmq
from grpc_health.v1 import health_pb2

from kvserve.messages.frontend_runner import PROTOCOL_VERSION, UP, Hello, RunnerStatus
from kvserve.v1 import generator_pb2 as pb

from .conftest import start_frontend, stop_frontend

pytestmark = pytest.mark.timeout(60)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def test_runner_of_another_protocol_version_is_refused(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    # Started inside the test, so that capfd holds the frontend's stderr (its log).
    fe = start_frontend(tmp_path / "rt")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"r-future")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(fe.zmq_address)
    good = None
    try:
        future = PROTOCOL_VERSION + 1
        sock.send(UP.encode(Hello(runner_id="r-future", pid=os.getpid(), model="fake", max_running=4,
                                  max_context_len=64, protocol=future)))
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
    finally:
        sock.close(0)
        ctx.term()
        if good is not None:
            good.kill()
        assert stop_frontend(fe) == 0
    log = capfd.readouterr().err
    assert (f"runner r-future (pid {os.getpid()}) refused: it speaks protocol version {future}, "
            f"this frontend speaks {PROTOCOL_VERSION} (1 refused so far)") in log
    assert "runner r-now" in log and "connected" in log
