"""memsvc micro-benchmarks: step round trip vs a bare pyzmq echo, allocator, radix cache.

    .venv/bin/python bench/memsvc_bench.py [--iters 2000]

1. A 64-item `Step` (64 Grow items on admitted requests) sent to a real `kvserve memsvc`
   over ipc://, median and p99, beside a bare pyzmq ROUTER echo process that msgpack-
   decodes and re-encodes the same payload, measured in the same run.
2. PageAllocator: slots allocated and freed per second, in batches of 256.
3. RadixCache: match + insert for 10,000 requests sharing 10 system prompts of 512 tokens.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import msgpack
import numpy as np
import zmq

from kvserve.memsvc.allocator import PageAllocator
from kvserve.memsvc.client import Admit, Grow, MemClient
from kvserve.memsvc.radix import RadixCache
from kvserve.messages.runner_memsvc import REQUESTS, Step

ECHO = """
import sys, msgpack, zmq
s = zmq.Context().socket(zmq.ROUTER); s.bind(sys.argv[1]); print("ready", flush=True)
while True:
    ident, frame = s.recv_multipart()
    s.send_multipart([ident, msgpack.packb(msgpack.unpackb(frame))])
"""


def percentiles(samples: list[float]) -> tuple[float, float]:
    arr = np.array(samples) * 1e6
    return float(np.median(arr)), float(np.percentile(arr, 99))


def bench_step(iters: int) -> None:
    run = tempfile.mkdtemp(prefix="kvserve-bench-")
    env = dict(os.environ, KVSERVE_RUNTIME_DIR=run)
    memsvc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "memsvc", "--n-layers", "2",
                               "--n-kv-heads", "2", "--head-dim", "8", "--kv-tokens", "65536",
                               "--max-reqs", "128", "--max-context-len", "512", "--metrics-port", "0"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    echo_addr = f"ipc://{run}/echo.sock"
    echo = subprocess.Popen([sys.executable, "-c", ECHO, echo_addr], stdout=subprocess.PIPE, text=True)
    try:
        memsvc.stdout.readline()
        echo.stdout.readline()
        client = MemClient(f"ipc://{run}/memsvc.sock", name="bench")
        client.attach(n_layers=2, n_kv_heads=2, head_dim=8)
        reply = client.step(admit=[Admit(i, list(range(i, i + 100)), 128) for i in range(64)])
        assert all(r.ok for r in reply.admitted)
        grows = [Grow(i, 200) for i in range(64)]
        frame = REQUESTS.encode(Step(lease=client.lease or 0, grow=grows))
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(echo_addr)
        step_t, echo_t = [], []
        for _ in range(iters):
            t0 = time.perf_counter()
            client.step(grow=grows)
            step_t.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            sock.send(msgpack.packb(msgpack.unpackb(frame)))
            msgpack.unpackb(sock.recv())
            echo_t.append(time.perf_counter() - t0)
        sock.close(0)
        client.close()
        (sm, sp), (em, ep) = percentiles(step_t), percentiles(echo_t)
        print(f"step 64 grow items : median {sm:7.1f} us  p99 {sp:7.1f} us  ({len(frame)} B)")
        print(f"bare msgpack echo  : median {em:7.1f} us  p99 {ep:7.1f} us")
        print(f"ratio step/echo    : median {sm / em:.2f}x  p99 {sp / ep:.2f}x")
    finally:
        for proc in (memsvc, echo):
            proc.terminate()
            proc.wait(timeout=15)
            proc.stdout.close()
        shutil.rmtree(run, ignore_errors=True)  # the echo server leaves its socket file


def bench_allocator(rounds: int = 2000) -> None:
    alloc = PageAllocator(1 << 20)
    batches = 16
    t0 = time.perf_counter()
    for _ in range(rounds):
        held = [alloc.alloc(256) for _ in range(batches)]
        for slots in held:
            alloc.free(slots)
    dt = time.perf_counter() - t0
    print(f"allocator          : {rounds * batches * 256 / dt / 1e6:.2f} M slots/s (alloc+free, batches of 256)")


def bench_radix(n_requests: int = 10_000) -> None:
    rng = np.random.default_rng(0)
    systems = [rng.integers(0, 50_000, 512) for _ in range(10)]
    reqs = [np.concatenate([systems[i % 10], rng.integers(0, 50_000, 32)]) for i in range(n_requests)]
    tree, next_slot = RadixCache(), 1
    t0 = time.perf_counter()
    for tokens in reqs:
        m = tree.match_prefix(tokens, count=True)
        n = len(tokens) - len(m.slots)
        tree.insert(tokens, np.concatenate([m.slots, np.arange(next_slot, next_slot + n)]))
        next_slot += n
    dt = time.perf_counter() - t0
    print(f"radix match+insert : {n_requests / dt:,.0f} requests/s "
          f"(hit rate {tree.hit_tokens / tree.queried_tokens:.3f})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=2000)
    args = parser.parse_args()
    bench_allocator()
    bench_radix()
    bench_step(args.iters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
