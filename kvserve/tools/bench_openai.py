"""`kvserve bench --api openai`: drive POST /v1/completions, streamed, on any OpenAI-compatible
server (kvserve's HTTP face, vLLM, SGLang, llama.cpp's server).

`_connect_openai` opens one shared HTTP client for --url (the model from GET /v1/models
unless --model names it) and yields a `Server` whose `send` streams one completion into a
`Record` (`run_one_openai`); `parse_completion_stream` turns the server-sent events into
the same measurements as the gRPC path. Transport failures become a status string.

This module only talks the OpenAI HTTP API; it knows nothing of the server's internals,
the gRPC driver, or how a run is scheduled and reported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager

import httpx

from kvserve.tools.bench_report import Record
from kvserve.tools.bench_workload import Server, ServerError, Workload, _sampling_seed

# Random prompt ids stay below this in --api openai mode unless --vocab-size says otherwise:
# Llama 2 has 32000 entries, Mistral 32768, SmolLM2 49152, Llama 3 128256, Qwen2 151936.
OPENAI_VOCAB_SIZE = 32000


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
