"""memsvc micro-benchmarks: step round trip vs a bare pyzmq echo, allocator, radix cache.

    .venv/bin/python bench/memsvc_bench.py [--iters 2000]

1. A 64-item `Step` (64 Grow items on admitted requests) sent to a real `kvserve memsvc`
   over ipc://, median and p99, beside a bare pyzmq ROUTER echo process that msgpack-
   decodes and re-encodes the same payload, measured in the same run.
2. PageAllocator: slots allocated and freed per second, in batches of 256.
3. RadixCache: match + insert for 10,000 requests sharing 10 system prompts of 512 tokens.
4. KV-cache events (--events): what publishing costs. In process: the radix run of 3 with
   `BlockEvents` listening (block size 16) and every event batch encoded and sent on a PUB
   socket, against 3 without. Over the wire: a real memsvc with events off and one with
   events on (a SUB draining them in a thread), each driven by the same steps, each
   admitting 16 fresh 256-token prompts and releasing the 16 of the step before into the
   cache (so every step stores 256 blocks and, once the pool is full, evicts as many):
   median and p99 step round trip of both, and the events each step published; steps
   back to back (memsvc saturated) and 5 ms apart (a runner computing between steps).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import msgpack
import numpy as np
import zmq

from kvserve.memsvc.allocator import PageAllocator
from kvserve.memsvc.client import Admit, Grow, MemClient, Release
from kvserve.memsvc.kv_events import BlockEvents, EventPublisher
from kvserve.memsvc.radix import RadixCache
from kvserve.messages.runner_memsvc import REQUESTS, Step
from kvserve.tools.servectl import free_block

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


def bench_radix(n_requests: int = 10_000, publisher: EventPublisher | None = None) -> float:
    """Requests per second of match + insert; with `publisher`, events are made and sent too."""
    rng = np.random.default_rng(0)
    systems = [rng.integers(0, 50_000, 512) for _ in range(10)]
    reqs = [np.concatenate([systems[i % 10], rng.integers(0, 50_000, 32)]) for i in range(n_requests)]
    events = BlockEvents(16) if publisher is not None else None
    tree, next_slot = RadixCache(1, events), 1
    t0 = time.perf_counter()
    for tokens in reqs:
        m = tree.match_prefix(tokens, count=True)
        n = len(tokens) - len(m.slots)
        tree.insert(tokens, np.concatenate([m.slots, np.arange(next_slot, next_slot + n)]))
        next_slot += n
        if publisher is not None:
            publisher.publish(events.take())
    dt = time.perf_counter() - t0
    what = "+ events" if publisher is not None else "        "
    print(f"radix match+insert {what}: {n_requests / dt:,.0f} requests/s "
          f"(hit rate {tree.hit_tokens / tree.queried_tokens:.3f})")
    return n_requests / dt


def _drain(ctx: zmq.Context, live: str, counts: list[int], ready: threading.Event, stop: threading.Event) -> None:
    """A router's SUB, in its own thread (which owns the socket): count the messages."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(live)
    ready.set()
    while not stop.is_set():
        if sub.poll(50):
            sub.recv_multipart()
            counts[0] += 1
    sub.close(0)


def bench_events(iters: int) -> None:
    ctx = zmq.Context()
    run = tempfile.mkdtemp(prefix="kvserve-bench-")
    live, replay = f"tcp://127.0.0.1:{free_block(1)}", f"tcp://127.0.0.1:{free_block(1)}"
    pub = EventPublisher(ctx, live, f"tcp://127.0.0.1:{free_block(1)}")
    plain = bench_radix()
    with_events = bench_radix(publisher=pub)
    print(f"events in process  : {plain / with_events:.2f}x the time of match+insert without them "
          f"({pub.seq} messages)")
    pub.close()
    for gap in (0.0, 0.005):
        _bench_event_steps(ctx, run, live, replay, iters, gap)
    ctx.term()
    shutil.rmtree(run, ignore_errors=True)


def _bench_event_steps(ctx: zmq.Context, run: str, live: str, replay: str, iters: int, gap: float) -> None:
    results = {}
    for on in (False, True):
        flags = ["--kv-events-endpoint", live, "--kv-events-replay-endpoint", replay] if on else []
        env = dict(os.environ, KVSERVE_RUNTIME_DIR=f"{run}/{on}-{gap}")
        os.makedirs(env["KVSERVE_RUNTIME_DIR"])
        memsvc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "memsvc", "--n-layers", "2",
                                   "--n-kv-heads", "2", "--head-dim", "8", "--kv-tokens", "65536",
                                   "--max-reqs", "128", "--max-context-len", "512", "--metrics-port", "0",
                                   *flags], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        counts = [0]
        ready, stop = threading.Event(), threading.Event()
        drain = threading.Thread(target=_drain, args=(ctx, live, counts, ready, stop), daemon=True)
        try:
            memsvc.stdout.readline()
            if on:
                drain.start()
                ready.wait(10)
                time.sleep(0.3)
            client = MemClient(f"ipc://{env['KVSERVE_RUNTIME_DIR']}/memsvc.sock", name="bench")
            client.attach(n_layers=2, n_kv_heads=2, head_dim=8)
            rng = np.random.default_rng(1)
            held: list[tuple[int, list[int]]] = []
            times = []
            for it in range(iters):
                fresh = [(it * 16 + i, rng.integers(0, 50_000, 256).tolist()) for i in range(16)]
                t0 = time.perf_counter()
                reply = client.step(admit=[Admit(rid, ids, 1) for rid, ids in fresh],
                                    release=[Release(rid, ids) for rid, ids in held])
                times.append(time.perf_counter() - t0)
                held = [f for f, r in zip(fresh, reply.admitted, strict=True) if r.ok]
                if gap:
                    time.sleep(gap)
            client.close()
            time.sleep(0.3)
            results[on] = (*percentiles(times), counts[0])
        finally:
            memsvc.terminate()
            memsvc.wait(timeout=15)
            memsvc.stdout.close()
            stop.set()
            if drain.is_alive():
                drain.join(10)
    for on, (med, p99, n) in results.items():
        print(f"step admit16+release16 {gap * 1000:.0f} ms apart, events {'on ' if on else 'off'}: median {med:7.1f} us  p99 {p99:7.1f} us"
              + (f"  ({n} messages received, {n / iters:.2f} per step)" if on else ""))
    print(f"events on/off      : median {results[True][0] / results[False][0]:.2f}x  "
          f"p99 {results[True][1] / results[False][1]:.2f}x")



def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--events", action="store_true", help="only the KV-event costs (4.)")
    args = parser.parse_args()
    if args.events:
        bench_events(args.iters)
        return 0
    bench_allocator()
    bench_radix()
    bench_step(args.iters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
