"""Integration: a real `kvserve memsvc` and real client processes sharing the pool."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvserve.memsvc.client import MemClient

HERE = Path(__file__).parent


def run_client(address: str, mode: str, name: str) -> dict:
    out = subprocess.run([sys.executable, str(HERE / "client_proc.py"), address, mode, name],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def wait_for(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in metrics")


@pytest.mark.timeout(150)
def test_share_prefix_reclaim_and_restart(run_dir: Path, memsvc_factory) -> None:
    start_memsvc = memsvc_factory
    shm_before = set(os.listdir("/dev/shm"))
    with start_memsvc(run_dir) as svc:
        sock = run_dir / "memsvc.sock"
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600
        assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700

        wrote = run_client(svc.address, "write", "writer")
        assert wrote["ok"] and wrote["cached_len"] == 0
        read = run_client(svc.address, "read", "reader")
        assert read["ok"] and read["cached_len"] == 19  # prefix of token_ids[:-1]
        assert read["k_equal"] and read["v_equal"]

        observer = MemClient(svc.address, name="observer", timeout_s=10)
        try:
            holder = subprocess.Popen([sys.executable, str(HERE / "client_proc.py"), svc.address, "hold", "holder"],
                                      stdout=subprocess.PIPE, text=True)
            try:
                assert json.loads(holder.stdout.readline())["ok"]
                st = observer.stats()
                assert st.clients == 1 and st.rows_used == 1 and "holder" in st.leases
                os.kill(holder.pid, signal.SIGKILL)
                holder.wait(timeout=10)
                killed = time.monotonic()
                assert wait_for(lambda: observer.stats().clients == 0, 5)
                assert time.monotonic() - killed < 2.0
            finally:
                if holder.poll() is None:
                    holder.kill()
                    holder.wait()
                holder.stdout.close()
            st = observer.stats()
            assert st.rows_used == 0 and st.slots_request == 0 and st.leases_reclaimed == 1
            assert st.slots_cached == 20 and st.prefix_hit_tokens >= 19 * 2
            text = svc.metrics()
            assert metric(text, "kvserve_memsvc_leases_reclaimed_total") == 1.0
            assert metric(text, "kvserve_memsvc_clients") == 0.0
            assert metric(text, 'kvserve_kv_cache_slots{state="cached"}') == 20.0
            assert metric(text, "kvserve_prefix_cache_hits_total") >= 38
            assert metric(text, "kvserve_memsvc_invariant_violations_total") == 0.0
            assert 'policy="reserve"' in text and "kvserve_memsvc_step_latency_seconds_bucket" in text
        finally:
            observer.close()
        assert svc.stop() == 0
        assert not sock.exists()
    assert os.listdir(run_dir) == []
    with start_memsvc(run_dir) as svc:  # restart: fresh pool, same address
        client = MemClient(svc.address, timeout_s=10)
        try:
            assert client.stats().slots_cached == 0
        finally:
            client.close()
        assert svc.stop() == 0
    assert os.listdir(run_dir) == []
    assert set(os.listdir("/dev/shm")) - shm_before == set()


@pytest.mark.timeout(60)
def test_client_notices_memsvc_death_within_a_heartbeat(run_dir: Path, memsvc_factory) -> None:
    # A runner on memsvc's host must not wait for a timeout or a restarted memsvc to learn
    # that its pool is gone: the heartbeat thread watches memsvc's pid.
    with memsvc_factory(run_dir) as svc:
        client = MemClient(svc.address, name="watcher", timeout_s=10)
        try:
            layout = client.attach(n_layers=2, n_kv_heads=2, head_dim=8)
            assert layout.n_layers == 2 and not client.lease_lost
            time.sleep(0.5)
            assert not client.lease_lost  # heartbeats are answered while memsvc lives
            os.kill(svc.proc.pid, signal.SIGKILL)
            svc.proc.wait(timeout=10)
            killed = time.monotonic()
            assert wait_for(lambda: client.lease_lost, 3)
            assert time.monotonic() - killed < 1.0
        finally:
            client.lease = None  # memsvc is gone: nothing to detach from
            client.close()
