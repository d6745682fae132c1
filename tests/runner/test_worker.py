"""`kvserve runner` as a real process between a real memsvc and a fake frontend ROUTER.

Checks the frontend link (Hello, RunnerStatus, one TokenBatch per step with the right
tokens), aborts, malformed frames, memsvc dying and coming back (in-flight requests fail
with "error", the runner re-attaches), and a clean exit 0 on SIGTERM.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Any

import pytest
import torch
import zmq

from kvserve.kernels import get_backend
from kvserve.memsvc.client import MemClient
from kvserve.messages.frontend_runner import (
    DOWN,
    UP,
    AbortReq,
    GenerateReq,
    Hello,
    RunnerStatus,
    TokenBatch,
)
from kvserve.model.weights import load_model
from kvserve.runner.scheduler import Scheduler
from kvserve.tools.servectl import free_block

from .runner_procs import (
    attached,
    greedy,
    memsvc_args,
    memsvc_process,
    random_prompts,
    run_all,
    sharp_tiny_dir,
    tokens_of,
)


class FakeFrontend:
    """A ROUTER socket like the frontend's, collecting what runners send."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.bind(address)
        self.hellos: list[Hello] = []
        self.statuses: list[RunnerStatus] = []
        self.batches: list[TokenBatch] = []

    def pump(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000)):
                return
            ident, frame = self.sock.recv_multipart()
            msg = UP.decode(frame)
            assert ident.decode() == msg.runner_id
            {Hello: self.hellos, RunnerStatus: self.statuses, TokenBatch: self.batches}[type(msg)].append(msg)

    def wait(self, pred: Any, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not pred():
            assert time.monotonic() < deadline, "timed out waiting for the runner"
            self.pump(0.1)

    def send(self, runner: str, msg: Any) -> None:
        self.sock.send_multipart([runner.encode(), DOWN.encode(msg)])

    def outputs(self, request_id: str) -> list[Any]:
        return [o for b in self.batches for o in b.outputs if o.request_id == request_id]

    def done(self, request_id: str) -> bool:
        outs = self.outputs(request_id)
        return bool(outs) and outs[-1].finish_reason != ""

    def close(self) -> None:
        if not self.sock.closed:
            self.sock.close(0)
            self.ctx.term()


@pytest.mark.timeout(150)
def test_runner_process_serves_aborts_survives_memsvc_restart(tmp_path_factory: pytest.TempPathFactory) -> None:
    model_dir = sharp_tiny_dir(tmp_path_factory)
    run_dir = tmp_path_factory.mktemp("wrun")
    run_dir.chmod(0o700)
    lm = load_model(str(model_dir), dtype=torch.float32)
    prompts = random_prompts(21, [12, 30, 7])
    params = greedy(max_new=12)
    margs = memsvc_args(lm.config, max_context_len=2048)
    fe = FakeFrontend(f"ipc://{run_dir}/frontend.sock")
    proc = None
    metrics = free_block(1)
    try:
        with memsvc_process(run_dir, margs) as address:
            with attached(address, lm.config) as client:
                sched = Scheduler(model=lm.model, mem=client, layout=client.layout,
                                  backend=get_backend("torch"), eos_token_ids=lm.eos_token_ids)
                expected = tokens_of(run_all(sched, [GenerateReq(f"e{i}", p, params) for i, p in enumerate(prompts)]))
            env = dict(os.environ, KVSERVE_RUNTIME_DIR=str(run_dir))
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvserve.cli", "runner", "--model", str(model_dir),
                 "--device", "cpu", "--dtype", "float32", "--memsvc-address", address,
                 "--runner-id", "r1", "--metrics-port", str(metrics), "--threads", "1",
                 "--runtime-dir", str(run_dir)],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            fe.wait(lambda: fe.hellos, 90)
            hello = fe.hellos[0]
            assert hello.runner_id == "r1" and hello.pid == proc.pid and hello.max_context_len == 2048
            n = len(fe.statuses)
            fe.pump(0.6)
            assert len(fe.statuses) >= n + 2  # every <= 0.25 s
            assert fe.statuses[-1].memsvc_ok and fe.statuses[-1].running == 0

            fe.sock.send_multipart([b"r1", b"\x93garbage"])  # malformed: logged, counted, ignored
            for i, p in enumerate(prompts):
                fe.send("r1", GenerateReq(f"g{i}", p, params, arrival_time=time.time()))
            fe.send("r1", GenerateReq("long", prompts[0], greedy(max_new=2000)))  # outlasts the checks below
            fe.wait(lambda: all(fe.done(f"g{i}") for i in range(3)))
            for i in range(3):
                outs = fe.outputs(f"g{i}")
                assert [t for o in outs for t in o.token_ids] == expected[f"e{i}"]
                assert outs[-1].finish_reason == "length" and outs[0].queue_time >= 0.0
            page = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5).read().decode()
            assert "\nkvserve_runner_bad_messages_total{reason=\"malformed\"} 1.0\n" in page
            multi = [b for b in fe.batches if len({o.request_id for o in b.outputs}) > 1]
            assert multi, "the batch's tokens must travel together, one TokenBatch per step"
            fe.send("r1", AbortReq("long"))
            fe.wait(lambda: fe.done("long"))
            assert fe.outputs("long")[-1].finish_reason == "abort"

            fe.send("r1", GenerateReq("cut", prompts[1], greedy(max_new=2000)))
            fe.wait(lambda: len(fe.outputs("cut")) >= 2)
        # memsvc stopped (context exit) while "cut" was running
        fe.wait(lambda: fe.done("cut"), 30)
        last = fe.outputs("cut")[-1]
        assert last.finish_reason == "error" and "memsvc" in last.error
        fe.wait(lambda: not fe.statuses[-1].memsvc_ok, 10)
        with memsvc_process(run_dir, margs) as address:
            fe.wait(lambda: fe.statuses[-1].memsvc_ok, 60)  # re-attached
            fe.send("r1", GenerateReq("again", prompts[2], params))
            fe.wait(lambda: fe.done("again"))
            assert [t for o in fe.outputs("again") for t in o.token_ids] == expected["e2"]
            # the Hello repeats (a restarted frontend learns of the runner), always with the
            # same pid, which a frontend that knows the runner takes as a refresh
            assert len(fe.hellos) >= 2 and {h.pid for h in fe.hellos} == {proc.pid}
            # the frontend goes away mid-stream: the runner cannot hand over the next token
            # batch, so after SEND_TIMEOUT_S it aborts the request (counted), never running on
            fe.send("r1", GenerateReq("orphan", prompts[0], greedy(max_new=2000)))
            fe.wait(lambda: len(fe.outputs("orphan")) >= 2)
            fe.close()
            stats = MemClient(address, name="probe", timeout_s=5)
            try:
                end = time.monotonic() + 10
                while stats.stats().slots_request and time.monotonic() < end:
                    time.sleep(0.1)
                assert stats.stats().slots_request == 0, "the orphaned request still holds KV"
            finally:
                stats.close()
            page = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5).read().decode()
            assert "\nkvserve_runner_undelivered_outputs_total 1.0\n" in page
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=20) == 0
        out = proc.stdout.read() if proc.stdout else ""
        assert "runner r1 ready" in out
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc is not None and proc.stdout is not None:
            proc.stdout.close()
        fe.close()


def test_bad_flag_exits_2(tmp_path: Any) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "runner", "--dtype", "float8", "--metrics-port", "0"],
        capture_output=True, text=True, timeout=60, env=dict(os.environ, KVSERVE_RUNTIME_DIR=str(tmp_path)),
    )
    assert proc.returncode == 2 and "dtype" in proc.stderr
