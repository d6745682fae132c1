"""The KV tiers through a real `kvserve serve` (tiny model, a 384-token pool, a host tier and
a disk tier): a prompt evicted from the pool comes back from host memory, and after a
kill -9 of memsvc the new memsvc serves it from disk; each time the greedy output equals the
cold one token for token."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from .harness import DEFAULT_PATH, Service, greedy, start_serve, stop_serve

pytestmark = pytest.mark.timeout(240)
KV_TOKENS = 384
PROMPT = "The tiers keep what the pool lets go. " * 4  # 152 bytes: 9 whole blocks of 16
BLOCK = 16


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Service]:
    disk = tmp_path_factory.mktemp("disk-tier")
    service = start_serve(tmp_path_factory.mktemp("tiers-rt"), tiny_model, "--kv-tokens", str(KV_TOKENS),
                          "--policy", "reserve", "--host-cache-bytes", "64MiB", "--disk-cache-dir", str(disk),
                          "--disk-cache-bytes", "64MiB", *DEFAULT_PATH, dtype=None)
    service.disk = disk  # type: ignore[attr-defined]
    try:
        yield service
    finally:
        assert stop_serve(service) == 0


def generate(svc: Service, text: str, max_new: int = 24, *, within_s: float = 0.0) -> tuple[list[int], int]:
    """(token ids, cached prompt tokens) of a greedy Generate; retried while UNAVAILABLE for `within_s`."""
    end = time.monotonic() + within_s
    while True:
        try:
            out = list(svc.stub.Generate(greedy(text, max_new), timeout=60))
            return [t for m in out for t in m.token_ids], out[-1].usage.cached_tokens
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < end, exc
            time.sleep(0.25)


def tier_hits(svc: Service, tier: str) -> float:
    return svc.metric(1, f'kvserve_kv_tier_hit_tokens_total{{tier="{tier}"}}')


def test_evicted_prompt_comes_back_from_host_memory_with_the_cold_output(svc: Service) -> None:
    cold, cached = generate(svc, PROMPT)
    assert cached == 0
    for i in range(3):  # 3 x ~190 reserved slots in a 384-slot pool: the prompt's blocks go
        generate(svc, f"{i} other text to push the first prompt out of the pool " * 3, 8)
    st = svc.stats()
    assert st.slots_cached < KV_TOKENS
    again, cached = generate(svc, PROMPT)
    assert cached >= 9 * BLOCK - BLOCK, cached  # whole blocks came back (at most the last is recomputed)
    assert tier_hits(svc, "host") >= BLOCK
    assert again == cold


def test_after_kill9_of_memsvc_the_new_one_serves_the_prompt_from_disk(svc: Service) -> None:
    cold, _ = generate(svc, PROMPT)
    files = lambda: list(svc.disk.rglob("*.kvb"))  # noqa: E731
    end = time.monotonic() + 10
    while len(files()) < 9 and time.monotonic() < end:  # the write-through reaches the disk
        time.sleep(0.1)
    assert len(files()) >= 9
    old = svc.pids()["memsvc"]
    os.kill(old, signal.SIGKILL)
    assert svc.wait_serving(90)
    again, cached = generate(svc, PROMPT, within_s=90)
    assert svc.pids()["memsvc"] != old
    assert cached >= 8 * BLOCK, cached
    assert tier_hits(svc, "disk") >= 8 * BLOCK
    assert again == cold


def test_a_second_memsvc_on_the_same_disk_directory_exits_2_naming_it(svc: Service, tiny_model: Path,
                                                                       tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "memsvc", "--model", str(tiny_model), "--disk-cache-dir", str(svc.disk),
         "--address", f"ipc://{tmp_path}/other.sock", "--metrics-port", "0", "--kv-tokens", "64"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"--disk-cache-dir {svc.disk}: another memsvc uses this directory" in out.stderr
