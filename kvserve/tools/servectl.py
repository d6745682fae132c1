"""A real `kvserve serve` run from a script or a test: start it, find its children, read its
health, metrics, memsvc stats and RSS, stop it and check that nothing is left behind.

`start_serve` starts one `kvserve serve` (free ports, the given runtime dir, float32 on CPU
unless told otherwise) and waits until it prints that it is serving; `stop_serve` sends
SIGTERM and raises `LeftBehind` when a process, a socket file or a /dev/shm entry
outlives it. Used by the fault tests, bench/soak.py and bench/idle_memory.py. Knows
processes, gRPC and memsvc's Stats message, nothing of the children's internals.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvserve.memsvc.client import MemClient
from kvserve.messages.runner_memsvc import StatsReply
from kvserve.v1 import generator_pb2_grpc as pb_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
ROLES = ("memsvc", "runner", "frontend")


def free_block(n: int) -> int:
    """A base port with n consecutive free ports on 127.0.0.1."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return base
    raise RuntimeError("no free port block")


def children_of(pid: int) -> dict[int, str]:
    """{pid: command line} of the direct children of `pid`."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            out[int(entry.name)] = cmd
    return out


def stop_process(proc: subprocess.Popen, timeout: float = 15.0) -> int:
    """SIGTERM `proc` if it still runs, wait up to `timeout` s, then SIGKILL; its exit status."""
    if proc.poll() is None:
        proc.terminate()
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def rss_kib(pid: int) -> int:
    """Resident set size of `pid` in KiB (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def memfd_mappings(pid: int) -> set[str]:
    """Distinct kvserve memfd buffers (by inode) that `pid` maps."""
    try:
        lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return set()
    return {f"{parts[4]}:{parts[5]}" for parts in (ln.split() for ln in lines)
            if len(parts) >= 6 and parts[5].startswith("/memfd:kvserve-")}


@dataclass
class Service:
    """One running `kvserve serve`."""

    proc: subprocess.Popen
    port: int
    metrics_base: int
    runtime: Path
    channel: grpc.Channel
    stub: pb_grpc.GeneratorStub
    health: health_pb2_grpc.HealthStub
    shm_before: set[str] = field(default_factory=set)
    http_port: int = 0  # the OpenAI HTTP face (0 = off)
    kv_events: tuple[str, str] | None = None  # memsvc's KV-event (PUB, replay) endpoints, if published

    @property
    def url(self) -> str:
        """Base URL of the OpenAI HTTP face."""
        return f"http://127.0.0.1:{self.http_port}"

    def pids(self) -> dict[str, int]:
        """{role: pid} of the live children (first runner only)."""
        out: dict[str, int] = {}
        for pid, cmd in children_of(self.proc.pid).items():
            for role in ROLES:
                if f"kvserve.cli {role} " in cmd:
                    out.setdefault(role, pid)
        return out

    def role_pids(self) -> dict[str, list[int]]:
        """{role: sorted pids} of the live children, every runner included (a role that is
        restarting maps to an empty list)."""
        out: dict[str, list[int]] = {role: [] for role in ROLES}
        for pid, cmd in children_of(self.proc.pid).items():
            for role in ROLES:
                if f"kvserve.cli {role} " in cmd:
                    out[role].append(pid)
        return {role: sorted(pids) for role, pids in out.items()}

    def health_status(self) -> int:
        try:
            return self.health.Check(health_pb2.HealthCheckRequest(service="kvserve.v1.Generator"),
                                     timeout=2).status
        except grpc.RpcError:
            return -1

    def wait_health(self, status: int, timeout: float) -> bool:
        """Poll the health service until it reports `status` (False after `timeout` s)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.health_status() == status:
                return True
            time.sleep(0.1)
        return False

    def wait_serving(self, timeout: float) -> bool:
        return self.wait_health(SERVING, timeout)

    def stats(self) -> StatsReply:
        client = MemClient(f"ipc://{self.runtime / 'memsvc.sock'}", name="fault-test", timeout_s=3.0)
        try:
            return client.stats()
        finally:
            client.close()

    def wait_stats(self, pred, timeout: float) -> StatsReply:
        """Poll memsvc stats until `pred(stats)` holds; return the last stats either way."""
        end = time.monotonic() + timeout
        while True:
            try:
                st = self.stats()
                if pred(st) or time.monotonic() > end:
                    return st
            except Exception:  # memsvc restarting
                if time.monotonic() > end:
                    raise
            time.sleep(0.1)

    def metric(self, offset: int, name: str) -> float:
        """Sum of the samples of `name` on the metrics port base+offset (0 frontend, 1 memsvc,
        2 runner-0)."""
        url = f"http://127.0.0.1:{self.metrics_base + offset}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        values = [float(v) for v in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)]
        if not values:
            raise LookupError(f"no metric {name} on {url}")
        return sum(values)


class LeftBehind(RuntimeError):
    """Something of a stopped `kvserve serve` still exists."""


def start_serve(runtime: Path, model: Path | None, *extra: str, ready_s: float = 150.0,
                dtype: str | None = "float32", device: str | None = "cpu",
                log: Path | None = None, http: bool = False, kv_events: bool = False) -> Service:
    """Start `kvserve serve` on `model` (None = the embedded default) and wait until it serves.
    `dtype`/`device` None: serve's own default. `log`: a file that gets serve's stderr, which
    its children inherit (all their logs); None: this process's stderr. `http`: the OpenAI
    HTTP face on a free port (else off). `kv_events`: memsvc publishes KV-cache events on two
    free loopback ports (add `--kv-event-block-size` to `extra` for another block size)."""
    runtime.mkdir(mode=0o700, parents=True, exist_ok=True)
    port, metrics = free_block(1), free_block(5)
    http_port = free_block(1) if http else 0
    events = None
    if kv_events:
        ev = free_block(2)
        events = (f"tcp://127.0.0.1:{ev}", f"tcp://127.0.0.1:{ev + 1}")
        extra = ("--kv-events-endpoint", events[0], "--kv-events-replay-endpoint", events[1], *extra)
    env = dict(os.environ, KVSERVE_RUNTIME_DIR=str(runtime))
    env.pop("NOTIFY_SOCKET", None)
    shm_before = set(os.listdir("/dev/shm"))
    stderr = open(log, "a") if log is not None else None  # the child keeps its own copy
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve.cli", "serve", *(["--model", str(model)] if model else []),
         *(["--dtype", dtype] if dtype else []), *(["--device", device] if device else []),
         "--port", str(port), "--metrics-port", str(metrics), "--http-port", str(http_port),
         "--runtime-dir", str(runtime), "--ready-timeout-s", str(ready_s), *extra],
        env=env, stdout=subprocess.PIPE, stderr=stderr, text=True,
    )
    if stderr is not None:
        stderr.close()
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("kvserve serving on"):
            break
    else:
        raise RuntimeError(f"kvserve serve exited with {proc.wait()} before it was ready")
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # keep the pipe drained
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    return Service(proc, port, metrics, runtime, channel, pb_grpc.GeneratorStub(channel),
                   health_pb2_grpc.HealthStub(channel), shm_before, http_port, events)


def stop_serve(svc: Service, timeout: float = 60.0) -> int:
    """SIGTERM serve (if still running), wait, and check that nothing is left behind."""
    kids = list(children_of(svc.proc.pid)) if svc.proc.poll() is None else []
    if svc.proc.poll() is None:
        svc.proc.send_signal(signal.SIGTERM)
    try:
        rc = svc.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        svc.proc.kill()
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        rc = svc.proc.wait()
    svc.channel.close()
    left = [pid for pid in kids if Path(f"/proc/{pid}").exists()]
    if left:
        raise LeftBehind(f"children left running: {left}")
    if list(svc.runtime.iterdir()):
        raise LeftBehind(f"left in the runtime dir: {list(svc.runtime.iterdir())}")
    shm = set(os.listdir("/dev/shm")) - svc.shm_before
    if shm:
        raise LeftBehind(f"left in /dev/shm: {sorted(shm)}")
    return rc
