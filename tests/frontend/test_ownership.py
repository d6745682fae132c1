"""Who may speak for a request, and that no call waits forever (issue 14, items 3 and 4), with a
real `kvserve frontend` and fake runners:

- a runner that stalls past the frontend's timeout is dropped, its unstarted request moves
  to another runner, and when the stalled one wakes its tokens for that request are
  dropped, counted (`kvserve_frontend_dropped_outputs_total{reason="late"}`) and answered
  with an abort; it registers again by its repeated Hello;
- every attempt has a wire id of its own, so a client that reuses a request id never
  races its previous run;
- a call whose runner goes quiet ends UNAVAILABLE after the inactivity timeout, and the
  runner is told to abort.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from kvserve.tools.servectl import free_block
from kvserve.v1 import generator_pb2 as pb

from .conftest import Frontend, start_frontend, stop_frontend

SERVING = health_pb2.HealthCheckResponse.SERVING
INACTIVITY_S = 1.5


@pytest.fixture(scope="module")
def fe(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Frontend]:
    metrics_port = free_block(1)
    frontend = start_frontend(tmp_path_factory.mktemp("own-rt"), "--metrics-port", str(metrics_port),
                              "--request-inactivity-timeout-s", str(INACTIVITY_S))
    frontend.metrics_port = metrics_port
    try:
        yield frontend
    finally:
        assert stop_frontend(frontend) == 0


@pytest.fixture
def runners() -> Iterator[list]:
    made: list = []
    yield made
    for r in made:
        r.close()


def _dropped(fe: Frontend, reason: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{fe.metrics_port}/metrics", timeout=5).read().decode()
    line = f'kvserve_frontend_dropped_outputs_total{{reason="{reason}"}} '
    return float(next(ln for ln in text.splitlines() if ln.startswith(line)).split()[-1])


def _live(fe: Frontend) -> set[str]:
    return {r.runner_id for r in fe.stub.GetLoad(pb.GetLoadRequest(), timeout=5).runners}


def test_zombie_tokens_never_reach_the_retried_request(fe: Frontend, runners: list, tmp_path: Path) -> None:
    zombie = fe.runner("r-zombie", reply="ZOMBIE ZOMBIE ZOMBIE", hold=True, step_s=0.01)
    runners.append(zombie)
    assert zombie.wait_for(lambda: _live(fe) == {"r-zombie"})
    call = fe.stub.Generate(pb.GenerateRequest(text="x", request_id="same",
                                               sampling=pb.SamplingParams(max_new_tokens=8)), timeout=30)
    assert zombie.wait_for(lambda: len(zombie.generate_reqs()) == 1)
    good = fe.runner("r-good", reply="good text here", step_s=0.05)
    runners.append(good)
    assert good.wait_for(lambda: _live(fe) == {"r-zombie", "r-good"})
    before = _dropped(fe, "late")
    zombie.stall(2.0)  # > the frontend's runner timeout (0.5 s): dropped, the request moves on
    assert zombie.wait_for(lambda: _live(fe) == {"r-good"}, timeout=1.5)
    zombie.hold = False  # once awake it "generates" for the request it still has
    text = "".join(m.text for m in call)
    assert text == "good tex"  # 8 tokens of the good runner's reply, none of the zombie's
    old, new = zombie.generate_reqs()[0].request_id, good.generate_reqs()[0].request_id
    assert old != new
    assert zombie.wait_for(lambda: old in zombie.aborts(), timeout=5), "the zombie was not told to abort"
    assert _dropped(fe, "late") > before
    assert zombie.wait_for(lambda: "r-zombie" in _live(fe), timeout=5), "the woken runner did not register again"
    # the client reuses its request id at once: a new wire id, whatever the old runs still do
    again = list(fe.stub.Generate(pb.GenerateRequest(text="x", request_id="same",
                                                     sampling=pb.SamplingParams(max_new_tokens=4)), timeout=30))
    assert again[-1].finish_reason == "length" and again[-1].usage.completion_tokens == 4
    wire_ids = [m.request_id for r in (zombie, good) for m in r.generate_reqs()]
    assert len(wire_ids) == 3 and len(set(wire_ids)) == 3, wire_ids


def test_quiet_runner_fails_the_call_after_the_inactivity_timeout(fe: Frontend, runners: list) -> None:
    quiet = fe.runner("r-quiet", hold=True)
    runners.append(quiet)
    assert quiet.wait_for(lambda: _live(fe) == {"r-quiet"})
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        list(fe.stub.Generate(pb.GenerateRequest(text="x"), timeout=30))
    waited = time.monotonic() - start
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "request_inactivity_timeout_s" in info.value.details() and "r-quiet" in info.value.details()
    assert INACTIVITY_S <= waited < INACTIVITY_S + 3, waited
    wire = quiet.generate_reqs()[0].request_id
    assert quiet.wait_for(lambda: wire in quiet.aborts(), timeout=2)
