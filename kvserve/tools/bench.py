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

This module only talks gRPC or the OpenAI HTTP API (and reads a /metrics page if given);
it knows nothing of the server's internals.
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
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import httpx

from kvserve.tools.bench_report import Record, format_table, plot, scrape_prefix, summarize
from kvserve.v1 import generator_pb2 as pb
from kvserve.v1 import generator_pb2_grpc as pb_grpc

# Random prompt ids stay below this in --api openai mode unless --vocab-size says otherwise:
# Llama 2 has 32000 entries, Mistral 32768, SmolLM2 49152, Llama 3 128256, Qwen2 151936.
OPENAI_VOCAB_SIZE = 32000


@dataclass(frozen=True, slots=True)
class Workload:
    """One request to send: either token ids or text, and its output budget."""

    token_ids: list[int] | None
    text: str | None
    max_new_tokens: int


@dataclass(frozen=True, slots=True)
class Server:
    """A connected server: the vocabulary to draw prompt ids from, and how to send it one
    request (`send(workload, index, record, t0)` streams the answer into the record)."""

    vocab_size: int
    send: Callable[[Workload, int, Record, float], Awaitable[None]]


class ServerError(Exception):
    """The server could not be reached or described before the run (nothing was sent)."""


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
    """Build `n` requests: from --prompts-file, or random token ids of the given lengths.

    The draws are seeded by (--seed, --concurrency, --rate), so runs at different load
    levels send different prompts and a later run does not hit the prefix cache that an
    earlier one filled. The --shared-prefix system prompts are seeded by --seed alone:
    sharing them across levels is what that flag asks for.
    """
    rng = random.Random(f"{args.seed}/{args.concurrency}/{args.rate}")
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

    def ids(r: random.Random, k: int) -> list[int]:
        return [r.randrange(low_id, vocab_size) for _ in range(k)]

    prefix_rng = random.Random(args.seed)
    prefixes = [ids(prefix_rng, args.prefix_len) for _ in range(args.shared_prefix)]
    work = []
    for i in range(n):
        body = ids(rng, rng.randint(lo, hi))
        if prefixes:
            body = prefixes[i % len(prefixes)] + body
        work.append(Workload(body, None, rng.randint(out_lo, out_hi)))
    return work


def _sampling_seed(args: argparse.Namespace, index: int) -> int:
    """The per-request sampling seed when --temperature > 0 (the same in both APIs)."""
    return args.seed * 100003 + index


def _request(w: Workload, index: int, args: argparse.Namespace) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_new_tokens=w.max_new_tokens, ignore_eos=args.ignore_eos)
    if args.temperature > 0:
        sampling.temperature = args.temperature
        sampling.seed = _sampling_seed(args, index)
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


@asynccontextmanager
async def _connect_grpc(args: argparse.Namespace) -> AsyncIterator[Server]:
    """kvserve's gRPC API at --address; the vocabulary from GetModelInfo."""
    metadata = (("authorization", f"Bearer {args.auth_token}"),) if args.auth_token else ()
    timeout = args.request_timeout or None
    async with grpc.aio.insecure_channel(args.address) as channel:
        stub = pb_grpc.GeneratorStub(channel)
        try:
            info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            raise ServerError(f"{args.address}: {exc.code().name}: {exc.details()}") from None

        async def send(w: Workload, index: int, rec: Record, t0: float) -> None:
            await run_one(stub, _request(w, index, args), rec, t0, timeout, metadata)

        yield Server(args.vocab_size or info.vocab_size, send)


def parse_completion_stream(rec: Record, lines: Iterable[tuple[float, str]]) -> None:
    """Fill `rec` from the server-sent events of one streamed /v1/completions answer.

    `lines` are (arrival time, line) pairs; only `data:` lines count, up to `data: [DONE]`.
    A chunk whose choices[0].text is non-empty is a token event (the first sets
    `first_token`); choices[0].finish_reason sets `finish_reason`; the usage chunk sets
    `prompt_tokens`, `output_tokens` (usage.completion_tokens) and `cached_tokens`
    (usage.prompt_tokens_details.cached_tokens, when present).

    A chunk may carry several tokens (vLLM and kvserve send one chunk per engine step and
    hold back text that is not yet whole), and its token count is not on the wire. The
    total from usage (or one per text chunk, if the server sends no usage) is split over
    the text chunks as evenly as possible, the remainder going to the later chunks; then,
    as in the gRPC path, the first chunk's tokens have no gap and each later chunk's time
    since the previous one is divided evenly among its tokens. With one token per chunk
    this is exactly the gRPC measurement.

    Status: `BAD_STREAM` for a `data:` line that is not a JSON object, `STREAM_ERROR` for
    an error object in the stream, `TRUNCATED` when the stream ends without [DONE]; a
    status already set (the transport's) is kept.
    """
    text_times: list[float] = []
    completion_tokens: int | None = None
    status = "TRUNCATED"
    for now, line in lines:
        if not line.startswith("data:"):
            continue  # blank separators, ": keep-alive" comments, "event:" lines
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            status = "OK"
            break
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            chunk = None
        if not isinstance(chunk, dict):
            status = "BAD_STREAM"
            break
        if "error" in chunk or chunk.get("object") == "error":
            status = "STREAM_ERROR"
            break
        choices = chunk.get("choices") or []
        if choices:
            if choices[0].get("text"):
                text_times.append(now)
            if choices[0].get("finish_reason"):
                rec.finish_reason = str(choices[0]["finish_reason"])
        usage = chunk.get("usage")
        if usage:
            rec.prompt_tokens = int(usage.get("prompt_tokens") or rec.prompt_tokens)
            if usage.get("completion_tokens") is not None:
                completion_tokens = int(usage["completion_tokens"])
            rec.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    if rec.status == "OK":
        rec.status = status

    total = len(text_times) if completion_tokens is None else completion_tokens
    rec.output_tokens = total
    if not text_times:
        return
    rec.first_token = text_times[0]
    share, extra = divmod(total, len(text_times))
    counts = [share] * (len(text_times) - extra) + [share + 1] * extra
    last = text_times[0]
    for now, n in zip(text_times[1:], counts[1:], strict=True):
        if n:
            rec.token_gaps.extend([(now - last) / n] * n)
            last = now


# Transport failures by the first class that matches (httpx's timeouts come first: a
# ConnectTimeout is a TimeoutException, not a ConnectError).
_TRANSPORT_STATUS: tuple[tuple[type[Exception], str], ...] = (
    (httpx.TimeoutException, "TIMEOUT"),
    (httpx.ConnectError, "CONNECT_ERROR"),
    (httpx.RemoteProtocolError, "PROTOCOL_ERROR"),
    (httpx.ReadError, "READ_ERROR"),
    (httpx.WriteError, "WRITE_ERROR"),
)


def _transport_status(exc: Exception) -> str:
    return next((name for cls, name in _TRANSPORT_STATUS if isinstance(exc, cls)), "REQUEST_ERROR")


def _completion_body(w: Workload, index: int, args: argparse.Namespace, model: str) -> dict:
    body = {
        "model": model,
        "prompt": w.token_ids if w.token_ids is not None else (w.text or ""),
        "max_tokens": w.max_new_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": args.ignore_eos,
        "temperature": args.temperature,
    }
    if args.temperature > 0:
        body["seed"] = _sampling_seed(args, index)
    return body


async def run_one_openai(client: httpx.AsyncClient, url: str, body: dict, headers: dict[str, str],
                         rec: Record, t0: float, timeout: float | None) -> None:
    """Stream one POST /v1/completions into `rec` (times relative to `t0`, tokens, status)."""
    rec.start = time.perf_counter() - t0
    lines: list[tuple[float, str]] = []
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url, json=body, headers=headers) as resp:
                if not resp.is_success:
                    await resp.aread()
                    rec.status = f"HTTP_{resp.status_code}"
                else:
                    async for line in resp.aiter_lines():
                        lines.append((time.perf_counter() - t0, line))
    except TimeoutError:
        rec.status = "TIMEOUT"
    except httpx.RequestError as exc:
        rec.status = _transport_status(exc)
    rec.end = time.perf_counter() - t0
    parse_completion_stream(rec, lines)


@asynccontextmanager
async def _connect_openai(args: argparse.Namespace) -> AsyncIterator[Server]:
    """An OpenAI-compatible server at --url; one shared HTTP client for all streams."""
    base = args.url.rstrip("/")
    timeout = args.request_timeout or None
    headers = {"Authorization": f"Bearer {args.auth_token}"} if args.auth_token else {}
    # Closed loop: one connection per stream. Open loop: no cap, or the pool would queue
    # arrivals and turn the Poisson schedule into a closed loop. trust_env=False: measure
    # the server, not an HTTP proxy from the environment.
    cap = None if args.rate else args.concurrency
    limits = httpx.Limits(max_connections=cap, max_keepalive_connections=cap)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits, trust_env=False) as client:
        model = args.model or await _first_model(client, base, headers)

        async def send(w: Workload, index: int, rec: Record, t0: float) -> None:
            await run_one_openai(client, f"{base}/v1/completions", _completion_body(w, index, args, model),
                                 headers, rec, t0, timeout)

        yield Server(args.vocab_size or OPENAI_VOCAB_SIZE, send)


async def _first_model(client: httpx.AsyncClient, base: str, headers: dict[str, str]) -> str:
    url = f"{base}/v1/models"
    try:
        resp = await client.get(url, headers=headers, timeout=30)
    except httpx.RequestError as exc:
        raise ServerError(f"{url}: {_transport_status(exc)}: {exc}") from None
    if not resp.is_success:
        raise ServerError(f"{url}: HTTP {resp.status_code}: {resp.text[:200]}")
    try:
        return str(resp.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise ServerError(f"{url}: lists no model id; give --model") from None


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
