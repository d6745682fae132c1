"""`kvserve bench --api grpc`: drive kvserve's Generate stream.

`_connect_grpc` opens a channel to --address, reads the vocabulary from GetModelInfo and
yields a `Server` whose `send` streams one Generate call into a `Record` (`run_one`, which
bench/compare.py also calls directly).

This module only talks kvserve's public gRPC API (`kvserve.v1`); it knows nothing of the
server's internals, the OpenAI driver, or how a run is scheduled and reported.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc

from kvserve.tools.bench_report import Record
from kvserve.tools.bench_workload import Server, ServerError, Workload, _sampling_seed
from kvserve.v1 import generator_pb2 as pb
from kvserve.v1 import generator_pb2_grpc as pb_grpc


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
