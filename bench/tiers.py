"""The KV tiers on a working set larger than the pool: `python bench/tiers.py [--out FILE]`.

16 shared prefixes of 1,024 random token ids (their KV together 4x the pool), then questions
(a prefix plus 24 random tokens, 16 new tokens forced) on random prefixes at 8 streams, on
`kvserve serve` with the embedded default model and serve's default dtype and quantization,
three times: tiers off, a host tier of 2x the pool, that host tier plus a disk tier. Each run
first asks every prefix once (warm-up, not measured). Reported per run: TTFT p50 / p99 of the
questions, the mean wait from arrival to admission (the frontend's queue-time histogram),
prompt tokens computed (prompt minus cached) and the requests' cache hits; then
TTFT p50 of 16 more questions asked one at a time (no queueing for pool slots).

Then the restart: kill -9 of memsvc in the host + disk run; serve brings it back (a new
memsvc with the runner attached again), and the first request on a known prefix (the new memsvc has only the disk tier) is timed against the
cold prefill of a prefix never seen.

The CPU's flags are printed beside the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from kvserve.tools.servectl import Service, start_serve, stop_serve
from kvserve.v1 import generator_pb2 as pb

PREFIXES, PREFIX_LEN, QUESTION_LEN, NEW = 16, 1024, 24, 16
POOL_TOKENS = PREFIXES * PREFIX_LEN // 4
STREAMS = 8
ALONE = 16  # questions asked one at a time after the load
VOCAB = 49152  # the default model's
KV_BYTES_PER_TOKEN_BF16 = 2 * 30 * 3 * 64 * 2  # the default model: layers x KV heads x head dim, K and V


def cpu_flags() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("Model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("Flags")), [])
    keep = [f for f in flags if f.startswith(("avx", "amx")) or f in ("fma", "f16c")]
    return f"{model}; {os.cpu_count()} cores; {' '.join(keep)}"


def request(tokens: list[int]) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=tokens),
                              sampling=pb.SamplingParams(max_new_tokens=NEW, ignore_eos=True, temperature=0))


def timed(svc: Service, tokens: list[int], retry_s: float = 0.0) -> dict:
    """TTFT and usage of one streamed request (retried while UNAVAILABLE for `retry_s`)."""
    end = time.monotonic() + retry_s
    while True:
        t0 = time.perf_counter()
        ttft = None
        try:
            for msg in svc.stub.Generate(request(tokens), timeout=600):
                if ttft is None and msg.token_ids:
                    ttft = time.perf_counter() - t0
                usage = msg.usage
            return {"ttft": ttft, "prompt": usage.prompt_tokens, "cached": usage.cached_tokens}
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > end:
                raise
            time.sleep(0.2)


def questions(rng: random.Random, prefixes: list[list[int]], n: int) -> list[list[int]]:
    return [rng.choice(prefixes) + [rng.randrange(100, VOCAB) for _ in range(QUESTION_LEN)] for _ in range(n)]


def run_load(svc: Service, prompts: list[list[int]]) -> list[dict]:
    out: list[dict] = []
    lock = threading.Lock()
    todo = list(prompts)

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                p = todo.pop()
            r = timed(svc, p)
            with lock:
                out.append(r)

    threads = [threading.Thread(target=worker) for _ in range(STREAMS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def queue_wait(svc: Service) -> tuple[float, float]:
    """(seconds, requests) the frontend counted in its queue-time histogram so far: the wait
    from arrival to the runner's admission."""
    return (svc.metric(0, "kvserve_request_queue_time_seconds_sum"),
            svc.metric(0, "kvserve_request_queue_time_seconds_count"))


def tier_hits(svc: Service) -> dict[str, float]:
    """Prompt tokens memsvc served from each tier so far."""
    out = {}
    for tier in ("host", "disk"):
        try:
            out[tier] = svc.metric(1, f'kvserve_kv_tier_hit_tokens_total{{tier="{tier}"}}')
        except (LookupError, ValueError, OSError):  # no such tier in this run
            out[tier] = 0.0
    return out


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def one_run(name: str, extra: list[str], prefixes: list[list[int]], n_questions: int, seed: int,
            restart: bool, base: Path) -> dict:
    svc = start_serve(base / f"rt-{name}", None, "--kv-tokens", str(POOL_TOKENS), "--policy", "reserve",
                      *extra, ready_s=600.0, dtype=None, log=base / f"serve-{name}.log")
    try:
        for p in prefixes:  # warm-up: each prefix once
            timed(svc, p + [7])
        waited, hits = queue_wait(svc), tier_hits(svc)
        t0 = time.perf_counter()
        res = run_load(svc, questions(random.Random(seed), prefixes, n_questions))
        wall = time.perf_counter() - t0
        waited = [b - a for a, b in zip(waited, queue_wait(svc), strict=True)]
        hits = {tier: n - hits[tier] for tier, n in tier_hits(svc).items()}
        ttfts = [r["ttft"] for r in res]
        # the same kind of questions one at a time: no request waits for another's slots
        alone = [timed(svc, p)["ttft"] for p in questions(random.Random(seed + 2), prefixes, ALONE)]
        row = {"run": name, "requests": len(res), "wall_s": round(wall, 1),
               "ttft_p50_s": round(pct(ttfts, 50), 3), "ttft_p99_s": round(pct(ttfts, 99), 3),
               "alone_ttft_p50_s": round(pct(alone, 50), 3),
               "queue_wait_mean_s": round(waited[0] / max(waited[1], 1), 3),
               "prompt_tokens": sum(r["prompt"] for r in res),
               "computed_tokens": sum(r["prompt"] - r["cached"] for r in res),
               "cached_tokens": sum(r["cached"] for r in res)}
        for tier, n in hits.items():
            row[f"{tier}_hit_tokens"] = n
        if restart:
            rng = random.Random(seed + 1)
            cold = timed(svc, [rng.randrange(100, VOCAB) for _ in range(PREFIX_LEN + 1)])  # never seen
            time.sleep(2.0)  # the write-through of the questions reaches the disk
            old = svc.pids()["memsvc"]
            os.kill(old, signal.SIGKILL)
            # let it come back: a new memsvc with the runner attached again
            end = time.monotonic() + 120
            while svc.pids().get("memsvc", old) == old and time.monotonic() < end:
                time.sleep(0.1)
            svc.wait_stats(lambda st: st.clients >= 1, timeout=120)
            svc.wait_serving(120)
            warm = timed(svc, prefixes[0] + [rng.randrange(100, VOCAB) for _ in range(QUESTION_LEN)], retry_s=120)
            row["restart"] = {"cold_ttft_s": round(cold["ttft"], 3), "cold_cached": cold["cached"],
                              "after_kill9_ttft_s": round(warm["ttft"], 3), "after_kill9_cached": warm["cached"],
                              "speedup": round(cold["ttft"] / warm["ttft"], 2)}
        return row
    finally:
        stop_serve(svc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", default="off,host,host+disk")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(100, VOCAB) for _ in range(PREFIX_LEN)] for _ in range(PREFIXES)]
    host = f"{2 * POOL_TOKENS * KV_BYTES_PER_TOKEN_BF16 * 2}"  # 2x the pool at bf16 (x2 headroom for fp32)
    base = Path(tempfile.mkdtemp(prefix="kvserve-tiers-"))
    configs = {"off": [], "host": ["--host-cache-bytes", host],
               "host+disk": ["--host-cache-bytes", host, "--disk-cache-dir", str(base / "disk"),
                             "--disk-cache-bytes", "4GiB"]}
    print(f"cpu: {cpu_flags()}", flush=True)
    print(f"workload: {PREFIXES} prefixes x {PREFIX_LEN} tokens, pool {POOL_TOKENS} tokens, "
          f"{args.questions} questions (+{QUESTION_LEN} tokens, {NEW} new) at {STREAMS} streams", flush=True)
    rows = []
    for name in args.runs.split(","):
        row = one_run(name, configs[name], prefixes, args.questions, args.seed, name == "host+disk", base)
        print(json.dumps(row), flush=True)
        rows.append(row)
    print("\n| tiers | TTFT p50 | TTFT p99 | mean wait for admission | TTFT p50, one at a time "
          "| prompt tokens computed | cached | host hits | disk hits |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['ttft_p50_s']:.3f} s | {r['ttft_p99_s']:.3f} s | {r['queue_wait_mean_s']:.3f} s "
              f"| {r['alone_ttft_p50_s']:.3f} s "
              f"| {r['computed_tokens']:,} "
              f"of {r['prompt_tokens']:,} | {r['cached_tokens']:,} | {r['host_hit_tokens']:,.0f} | "
              f"{r['disk_hit_tokens']:,.0f} |")
    for r in rows:
        if "restart" in r:
            x = r["restart"]
            print(f"\nafter kill -9 of memsvc: first request on a known prefix TTFT {x['after_kill9_ttft_s']:.3f} s "
                  f"({x['after_kill9_cached']} cached) vs cold {x['cold_ttft_s']:.3f} s: {x['speedup']}x")
    if args.out:
        args.out.write_text(json.dumps({"cpu": cpu_flags(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
