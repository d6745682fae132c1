"""`kvserve bench`: a load generator for any running kvserve, over its public gRPC API.

Open loop (Poisson arrivals at `--rate` req/s) or closed loop (`--concurrency` streams),
prompts from length distributions or a JSONL file, an optional shared-prefix mode (k
system prompts x many user turns), bounded by `--num-requests` and/or `--duration`.
Prints a live progress line and, at the end, a table (requests/s, output tokens/s,
TTFT / inter-token / end-to-end p50 p90 p99, errors by status, prefix-cache hit rate);
`--json` writes the raw per-request records, `--plot` a PNG of latency CDFs and
throughput over time.

This module only talks gRPC (and reads a /metrics page if given); it knows nothing of
the server's internals.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from kvserve.tools.bench_report import Record, format_table, plot, scrape_prefix, summarize
from kvserve.v1 import generator_pb2 as pb
from kvserve.v1 import generator_pb2_grpc as pb_grpc


@dataclass(frozen=True, slots=True)
class Workload:
    """One request to send: either token ids or text, and its output budget."""

    token_ids: list[int] | None
    text: str | None
    max_new_tokens: int


def _parse_range(text: str, name: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)(?::(\d+))?", text.strip())
    if not m:
        raise ValueError(f"--{name}: expected N or LO:HI, got {text!r}")
    lo = int(m.group(1))
    hi = int(m.group(2) or lo)
    if lo <= 0 or hi < lo:
        raise ValueError(f"--{name}: need 0 < LO <= HI, got {text!r}")
    return lo, hi


def make_workloads(args: argparse.Namespace, vocab_size: int, n: int) -> list[Workload]:
    """Build `n` requests: from --prompts-file, or random token ids of the given lengths."""
    rng = random.Random(args.seed)
    out_lo, out_hi = _parse_range(args.output_len, "output-len")
    if args.prompts_file:
        rows = []
        for lineno, line in enumerate(Path(args.prompts_file).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{args.prompts_file}:{lineno}: not JSON ({exc})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError(f"{args.prompts_file}:{lineno}: expected {{\"prompt\": str, ...}}")
            rows.append(row)
        if not rows:
            raise ValueError(f"{args.prompts_file}: no prompts")
        return [
            Workload(None, rows[i % len(rows)]["prompt"],
                     int(rows[i % len(rows)].get("max_new_tokens") or rng.randint(out_lo, out_hi)))
            for i in range(n)
        ]
    lo, hi = _parse_range(args.prompt_len, "prompt-len")
    # Random ids from the bulk of the vocabulary: special tokens sit at the low end.
    low_id = min(1000, vocab_size // 4)

    def ids(k: int) -> list[int]:
        return [rng.randrange(low_id, vocab_size) for _ in range(k)]

    prefixes = [ids(args.prefix_len) for _ in range(args.shared_prefix)]
    work = []
    for i in range(n):
        body = ids(rng.randint(lo, hi))
        if prefixes:
            body = prefixes[i % len(prefixes)] + body
        work.append(Workload(body, None, rng.randint(out_lo, out_hi)))
    return work


def _request(w: Workload, index: int, args: argparse.Namespace) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_new_tokens=w.max_new_tokens, ignore_eos=args.ignore_eos)
    if args.temperature > 0:
        sampling.temperature = args.temperature
        sampling.seed = args.seed * 100003 + index
    req = pb.GenerateRequest(request_id=f"bench-{args.seed}-{index}", sampling=sampling)
    if w.token_ids is not None:
        req.token_ids.ids.extend(w.token_ids)
    else:
        req.text = w.text or ""
    return req


async def run_one(stub: pb_grpc.GeneratorStub, req: pb.GenerateRequest, rec: Record, t0: float,
                  timeout: float | None, metadata: tuple) -> None:
    """Stream one Generate call into `rec` (times relative to `t0`, tokens, status)."""
    rec.start = time.perf_counter() - t0
    last = None
    try:
        async for resp in stub.Generate(req, timeout=timeout, metadata=metadata):
            now = time.perf_counter() - t0
            n = len(resp.token_ids)
            if n:
                if rec.first_token is None:
                    rec.first_token = now
                elif last is not None:
                    rec.token_gaps.extend([(now - last) / n] * n)
                last = now
                rec.output_tokens += n
            if resp.finish_reason:
                rec.finish_reason = resp.finish_reason
                rec.prompt_tokens = resp.usage.prompt_tokens
                rec.cached_tokens = resp.usage.cached_tokens
    except grpc.aio.AioRpcError as exc:
        rec.status = exc.code().name
    rec.end = time.perf_counter() - t0


async def run(args: argparse.Namespace) -> tuple[list[Record], float, tuple[float, float] | None]:
    """Drive the server; return the records, the wall time and the prefix-cache delta."""
    metadata = (("authorization", f"Bearer {args.auth_token}"),) if args.auth_token else ()
    async with grpc.aio.insecure_channel(args.address) as channel:
        stub = pb_grpc.GeneratorStub(channel)
        info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30, metadata=metadata)
        n = args.num_requests or 100_000
        work = make_workloads(args, info.vocab_size, n)
        before = scrape_prefix(args.metrics_url)
        records: list[Record] = []
        t0 = time.perf_counter()
        deadline = t0 + args.duration if args.duration else math.inf
        timeout = args.request_timeout or None

        def new_record(i: int) -> Record:
            w = work[i]
            rec = Record(index=i, prompt_tokens=len(w.token_ids or []), max_new_tokens=w.max_new_tokens)
            records.append(rec)
            return rec

        progress = asyncio.create_task(_progress(records, t0, n, args.quiet))
        if args.rate:
            rng = random.Random(args.seed + 1)
            tasks = []
            for i in range(n):
                if time.perf_counter() >= deadline:
                    break
                tasks.append(asyncio.create_task(
                    run_one(stub, _request(work[i], i, args), new_record(i), t0, timeout, metadata)))
                await asyncio.sleep(rng.expovariate(args.rate))
            await asyncio.gather(*tasks)
        else:
            counter = iter(range(n))

            async def worker() -> None:
                for i in counter:
                    if time.perf_counter() >= deadline:
                        return
                    await run_one(stub, _request(work[i], i, args), new_record(i), t0, timeout, metadata)

            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        wall = time.perf_counter() - t0
        progress.cancel()
        after = scrape_prefix(args.metrics_url)
    prefix = None
    if before is not None and after is not None:
        prefix = (after[0] - before[0], after[1] - before[1])
    return records, wall, prefix


async def _progress(records: list[Record], t0: float, total: int, quiet: bool) -> None:
    if quiet or not sys.stderr.isatty():
        return
    while True:
        done = sum(1 for r in records if r.end)
        toks = sum(r.output_tokens for r in records)
        el = time.perf_counter() - t0
        width = 30
        frac = min(1.0, done / total) if total else 0.0
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        sys.stderr.write(f"\r[{bar}] {done}/{total} req  {toks / el if el else 0:.0f} tok/s  {el:.0f}s ")
        sys.stderr.flush()
        await asyncio.sleep(0.5)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvserve bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--address", default="127.0.0.1:50051", help="gRPC address of kvserve (default: %(default)s)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--rate", type=float, default=0.0, help="open loop: Poisson arrivals per second")
    mode.add_argument("--concurrency", type=int, default=8, help="closed loop: concurrent streams (default: %(default)s)")
    p.add_argument("--num-requests", type=int, default=64, help="requests to send (default: %(default)s; 0 = until --duration)")
    p.add_argument("--duration", type=float, default=0.0, help="stop sending after this many seconds (0 = no limit)")
    p.add_argument("--prompt-len", default="128", help="prompt tokens, N or LO:HI uniform (default: %(default)s)")
    p.add_argument("--output-len", default="128", help="max_new_tokens, N or LO:HI uniform (default: %(default)s)")
    p.add_argument("--prompts-file", help="JSONL with {\"prompt\": text, \"max_new_tokens\": n} per line")
    p.add_argument("--shared-prefix", type=int, default=0, help="k shared system prompts (0 = none)")
    p.add_argument("--prefix-len", type=int, default=512, help="tokens per shared system prompt (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly max_new_tokens (default: on)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600.0, help="per-request deadline in s (0 = none)")
    p.add_argument("--metrics-url", help="memsvc /metrics URL for the prefix hit rate, e.g. http://127.0.0.1:9401/metrics")
    p.add_argument("--auth-token", help="bearer token, if the server requires one")
    p.add_argument("--json", help="write the summary and raw per-request records here")
    p.add_argument("--plot", help="write a PNG of latency CDFs and throughput over time here")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    return p


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        for text, name in ((args.prompt_len, "prompt-len"), (args.output_len, "output-len")):
            _parse_range(text, name)
        if args.concurrency <= 0 or args.rate < 0 or args.num_requests < 0 or args.duration < 0:
            raise ValueError("--concurrency must be > 0; --rate, --num-requests, --duration >= 0")
        if not args.num_requests and not args.duration:
            raise ValueError("give --num-requests or --duration")
        if args.prompts_file and not Path(args.prompts_file).is_file():
            raise ValueError(f"--prompts-file {args.prompts_file}: no such file")
    except ValueError as exc:
        parser.error(str(exc))
    try:
        records, wall, prefix = asyncio.run(run(args))
    except grpc.aio.AioRpcError as exc:
        print(f"kvserve bench: {args.address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"kvserve bench: {exc}", file=sys.stderr)
        return 2
    if not args.quiet and sys.stderr.isatty():
        sys.stderr.write("\n")
    summary = summarize(records, wall, prefix)
    print(format_table(summary))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "records": [asdict(r) for r in records]}, indent=1))
    if args.plot:
        plot(records, args.plot)
    return 0 if summary["ok"] else 1
