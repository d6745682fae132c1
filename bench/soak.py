"""Soak `kvserve`: N concurrent random clients for a long time, then a leak report.

    .venv/bin/python bench/soak.py --duration-s 300 --concurrency 8 --model /path/to/model
    .venv/bin/python bench/soak.py --address 127.0.0.1:50051 --runtime-dir /run/kvserve ...

Without --address it starts its own `kvserve serve` (tmp runtime dir, free ports) and
stops it at the end (checking that nothing is left behind). Clients send random prompts
with random sampling parameters, cancel, abort and use short deadlines (the driver of
kvserve/tools/loadgen.py). The report: concurrency, requests/s, minutes, statuses,
unexpected outcomes, memsvc request-held slots after the run (leaked, must be 0),
invariant violations, and RSS (KiB) of every process at the start, peak and end.
Exit status 1 when anything unexpected happened or slots leaked.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

from kvserve.memsvc.client import MemClient  # noqa: E402
from kvserve.tools.loadgen import run_load  # noqa: E402
from kvserve.tools.servectl import rss_kib, start_serve, stop_serve  # noqa: E402
from kvserve.v1 import generator_pb2_grpc as pb_grpc  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=float, default=300.0, help="how long the clients run")
    p.add_argument("--concurrency", type=int, default=8, help="concurrent client threads")
    p.add_argument("--max-new", type=int, default=40, help="largest max_new_tokens a client asks for")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--address", default="", help="HOST:PORT of a running frontend ('' = start serve)")
    p.add_argument("--runtime-dir", default="", help="with --address: its runtime dir (memsvc.sock) for stats")
    p.add_argument("--pids", default="", help="with --address: comma-separated role=pid to sample RSS")
    p.add_argument("--model", default="", help="self-started serve: model ('' = the embedded default)")
    p.add_argument("--kv-tokens", type=int, default=4096, help="self-started serve: KV pool size")
    p.add_argument("--policy", default="optimistic", help="self-started serve: reserve | optimistic")
    return p


def _stats(runtime: str):
    if not runtime:
        return None
    client = MemClient(f"ipc://{Path(runtime) / 'memsvc.sock'}", name="soak", timeout_s=5.0)
    try:
        return client.stats()
    finally:
        client.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    svc = None
    if args.address:
        channel = grpc.insecure_channel(args.address)
        runtime = args.runtime_dir
        pids = {k: int(v) for k, v in (kv.split("=") for kv in args.pids.split(",") if kv)}
    else:
        runtime = tempfile.mkdtemp(prefix="kvserve-soak-")
        extra = ["--kv-tokens", str(args.kv_tokens), "--policy", args.policy]
        svc = start_serve(Path(runtime), Path(args.model) if args.model else None, *extra, ready_s=900)
        channel = svc.channel
        pids = svc.pids()
    stub = pb_grpc.GeneratorStub(channel)
    rss_start = {r: rss_kib(p) for r, p in pids.items()}
    peak = dict(rss_start)

    def sample() -> None:
        for r, p in pids.items():
            peak[r] = max(peak[r], rss_kib(p))

    res = run_load(stub, args.concurrency, args.duration_s, seed=args.seed, max_new=args.max_new, tick=sample)
    rss_end = {r: rss_kib(p) for r, p in pids.items()}
    st = None
    for _ in range(50):  # releases reach memsvc at the runner's next step
        st = _stats(runtime)
        if st is None or st.slots_request == 0:
            break
        time.sleep(0.1)
    print(f"concurrency      {res.clients}")
    print(f"duration         {res.elapsed_s / 60:.2f} min")
    print(f"requests         {res.requests} ({res.rate:.2f} req/s)")
    for key, n in sorted(res.statuses.items()):
        print(f"  {key:<28} {n}")
    print(f"unexpected       {len(res.unexpected)} {res.unexpected[:5]}")
    if st is not None:
        print(f"slots leaked     {st.slots_request} (rows {st.rows_used})")
        print(f"invariants       {st.invariant_violations} violations; bad messages {st.bad_messages}")
        print(f"prefix cache     {st.prefix_hit_tokens}/{st.prefix_queried_tokens} tokens hit")
    for r in pids:
        print(f"RSS {r:<12} start {rss_start[r]} KiB, peak {peak[r]} KiB, end {rss_end[r]} KiB")
    failed = bool(res.unexpected) or (st is not None and (st.slots_request or st.invariant_violations))
    if svc is not None:
        rc = stop_serve(svc)
        Path(runtime).rmdir()
        print(f"serve exit       {rc}")
        failed = failed or rc != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
