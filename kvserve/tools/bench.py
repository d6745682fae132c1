"""`kvserve bench`: a load generator for kvserve's gRPC API or any OpenAI-compatible server.

`--api grpc` (the default) drives kvserve's Generate stream; `--api openai --url URL`
drives POST URL/v1/completions, streamed, on any OpenAI-compatible server (kvserve's HTTP
face, vLLM, SGLang, llama.cpp's server) with the same workload, so runs against different
servers send identical prompts. Open loop (Poisson arrivals at `--rate` req/s) or closed
loop (`--concurrency` streams), prompts from length distributions or a JSONL file, an
optional shared-prefix mode (k system prompts x many user turns), bounded by
`--num-requests` and/or `--duration`. Prints a live progress line and, at the end, a table
(requests/s, output tokens/s, TTFT / inter-token / end-to-end p50 p90 p99, errors by
status, prefix-cache hit rate); `--json` writes the raw per-request records, `--plot` a
PNG of latency CDFs and throughput over time.

The workload is built in `bench_workload.py`, the requests are sent by `bench_grpc.py` or
`bench_openai.py`, the table and plot come from `bench_report.py`; this module parses the
command line, picks the driver, paces the arrivals and prints the result. None of them
knows the server's internals: only gRPC, the OpenAI HTTP API and a /metrics page if given.
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
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import asdict
from pathlib import Path

from kvserve.tools.bench_grpc import _connect_grpc
from kvserve.tools.bench_openai import OPENAI_VOCAB_SIZE, _connect_openai
from kvserve.tools.bench_report import Record, format_table, plot, scrape_prefix, summarize
from kvserve.tools.bench_workload import Server, ServerError, _parse_range, make_workloads

# How to reach each --api: an async context manager that connects and yields a Server.
CONNECT: dict[str, Callable[[argparse.Namespace], AbstractAsyncContextManager[Server]]] = {
    "grpc": _connect_grpc,
    "openai": _connect_openai,
}


async def run(args: argparse.Namespace) -> tuple[list[Record], float, tuple[float, float] | None]:
    """Drive the server; return the records, the wall time and the prefix-cache delta."""
    async with CONNECT[args.api](args) as server:
        n = args.num_requests or 100_000
        work = make_workloads(args, server.vocab_size, n)
        before = scrape_prefix(args.metrics_url)
        records: list[Record] = []
        t0 = time.perf_counter()
        deadline = t0 + args.duration if args.duration else math.inf

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
                tasks.append(asyncio.create_task(server.send(work[i], i, new_record(i), t0)))
                await asyncio.sleep(rng.expovariate(args.rate))
            await asyncio.gather(*tasks)
        else:
            counter = iter(range(n))

            async def worker() -> None:
                for i in counter:
                    if time.perf_counter() >= deadline:
                        return
                    await server.send(work[i], i, new_record(i), t0)

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
    p.add_argument("--api", choices=list(CONNECT), default="grpc",
                   help="grpc: kvserve's Generate stream at --address; openai: POST --url/v1/completions "
                        "(default: %(default)s)")
    p.add_argument("--address", default="127.0.0.1:50051", help="gRPC address of kvserve (default: %(default)s)")
    p.add_argument("--url", help="--api openai: base URL of the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="--api openai: the request's \"model\" (default: the first id of GET /v1/models)")
    p.add_argument("--vocab-size", type=int, default=0,
                   help="random prompt ids are drawn below this (0 = the server's from GetModelInfo with "
                        f"--api grpc; {OPENAI_VOCAB_SIZE} with --api openai, which every common vocabulary "
                        "reaches: Llama 2 32000, Mistral 32768, Llama 3 128256, Qwen2 151936)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--rate", type=float, default=0.0, help="open loop: Poisson arrivals per second")
    mode.add_argument("--concurrency", type=int, default=8, help="closed loop: concurrent streams (default: %(default)s)")
    p.add_argument("--num-requests", type=int, default=64, help="requests to send (default: %(default)s; 0 = until --duration)")
    p.add_argument("--duration", type=float, default=0.0, help="stop sending after this many seconds (0 = no limit)")
    p.add_argument("--prompt-len", default="128", help="prompt tokens, N or LO:HI uniform (default: %(default)s)")
    p.add_argument("--output-len", default="128", help="max_new_tokens, N or LO:HI uniform (default: %(default)s)")
    p.add_argument("--prompts-file", help="JSONL with {\"prompt\": text, \"max_new_tokens\": n} per line")
    p.add_argument("--shared-prefix", type=int, default=0,
                   help="k shared system prompts (0 = none); seeded by --seed alone, so runs at other "
                        "--concurrency/--rate share them")
    p.add_argument("--prefix-len", type=int, default=512, help="tokens per shared system prompt (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly max_new_tokens (default: on)")
    p.add_argument("--seed", type=int, default=0,
                   help="prompts are drawn from (seed, --concurrency, --rate), so load levels differ")
    p.add_argument("--request-timeout", type=float, default=600.0, help="per-request deadline in s (0 = none)")
    p.add_argument("--metrics-url", help="memsvc /metrics URL for the prefix hit rate, e.g. http://127.0.0.1:9401/metrics")
    p.add_argument("--auth-token", help="bearer token, if the server requires one (both APIs)")
    p.add_argument("--json", help="write the summary and raw per-request records here")
    p.add_argument("--plot", help="write a PNG of latency CDFs and throughput over time here")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    return p


def _check_args(args: argparse.Namespace) -> None:
    for text, name in ((args.prompt_len, "prompt-len"), (args.output_len, "output-len")):
        _parse_range(text, name)
    if args.concurrency <= 0 or args.rate < 0 or args.num_requests < 0 or args.duration < 0:
        raise ValueError("--concurrency must be > 0; --rate, --num-requests, --duration >= 0")
    if args.vocab_size < 0:
        raise ValueError("--vocab-size must be >= 0")
    if not args.num_requests and not args.duration:
        raise ValueError("give --num-requests or --duration")
    if args.prompts_file and not Path(args.prompts_file).is_file():
        raise ValueError(f"--prompts-file {args.prompts_file}: no such file")
    if args.api == "openai":
        if not args.url:
            raise ValueError("--api openai needs --url http://HOST:PORT")
        if not re.match(r"https?://[^/]", args.url):
            raise ValueError(f"--url: expected http://HOST:PORT, got {args.url!r}")
    elif args.url or args.model:
        raise ValueError("--url and --model are for --api openai")


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _check_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        records, wall, prefix = asyncio.run(run(args))
    except ServerError as exc:
        print(f"kvserve bench: {exc}", file=sys.stderr)
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
