"""Two kvserve nodes on this machine behind vllm-router: what each routing policy is worth.

    .venv/bin/python bench/scaleout.py [--model PATH] [--prefixes 8] [--questions 10]

Starts two `kvserve serve` nodes (the embedded default model unless --model; each with the
HTTP face, memsvc publishing KV-cache events, a pool of --pool-tokens) and, per policy
(kv_aware, cache_aware, round_robin), a fresh vllm-router in front of both. Each policy gets
a fresh set of --prefixes long shared prefixes (--prefix-words random words) asked
--questions short questions each (every prefix once first, then shuffled), sent by
`kvserve bench --api openai` at --concurrency streams. Reports per policy the cached-token
fraction (usage.prompt_tokens_details.cached_tokens over prompt_tokens), TTFT p50 / p99,
output tokens/s and the router's placement hits; then, at --event-streams streams with
random prompts through kv_aware, the KV-event messages and blocks per second each memsvc
published (its kvserve_memsvc_kv_event_* counters over the run's wall time), and the
router's resident memory growth per block announced (its index keeps every distinct block
it has seen). Prints the CPU's flags beside the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

from e2e_throughput import cpu_flags

from kvserve.tools import bench
from kvserve.tools.bench_report import summarize
from kvserve.tools.routerctl import POLICIES, prefix_prompts, start_router, stop_router
from kvserve.tools.servectl import Service, rss_kib, start_serve, stop_serve
from kvserve.v1 import generator_pb2 as pb

MODEL = "kvserve-node"


def _drive(url: str, args: argparse.Namespace, extra: list[str]) -> dict:
    ns = bench.build_parser().parse_args(["--api", "openai", "--url", url, "--model", MODEL, "--quiet",
                                          "--request-timeout", "600", *extra])
    records, wall, _ = asyncio.run(bench.run(ns))
    return summarize(records, wall, None)


def _event_counters(node: Service) -> tuple[float, float, float]:
    """(messages sent, blocks announced, blocks stored) so far."""
    return (node.metric(1, 'kvserve_memsvc_kv_event_messages_total{outcome="sent"}'),
            node.metric(1, "kvserve_memsvc_kv_event_blocks_total"),
            node.metric(1, 'kvserve_memsvc_kv_event_blocks_total{type="BlockStored"}'))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model path (default: the embedded default model)")
    p.add_argument("--pool-tokens", type=int, default=2048, help="KV slots per node")
    p.add_argument("--prefixes", type=int, default=8)
    p.add_argument("--questions", type=int, default=10)
    p.add_argument("--prefix-words", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--event-streams", type=int, default=32)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    model = Path(args.model) if args.model else None
    out: dict = {"cpu_flags": cpu_flags(), "args": vars(args), "policies": {}, "events": {}}
    with tempfile.TemporaryDirectory(prefix="kvs-scaleout-") as tmp:
        base = Path(tmp)
        nodes: list[Service] = []
        try:
            for name in ("a", "b"):
                nodes.append(start_serve(base / f"rt-{name}", model, "--kv-tokens", str(args.pool_tokens),
                                         "--served-model-name", MODEL, dtype=None, device=None, http=True,
                                         kv_events=True, log=base / f"serve-{name}.log"))
            n = args.prefixes * args.questions
            for seed, policy in enumerate(args.policies.split(",")):
                prompts = base / f"{policy}.jsonl"
                prefix_prompts(prompts, n_prefixes=args.prefixes, questions=args.questions,
                               prefix_words=args.prefix_words, max_new_tokens=args.max_tokens, seed=100 + seed)
                router = start_router(nodes, policy, model=MODEL, log=base / f"router-{policy}.log")
                try:
                    s = _drive(router.url, args, ["--prompts-file", str(prompts), "--num-requests", str(n),
                                                  "--concurrency", str(args.concurrency)])
                    hits = router.metric("vllm_router_kv_placement_lookups_total", result="hit")
                finally:
                    stop_router(router)
                out["policies"][policy] = {**s, "placement_hits": hits}
                print(f"{policy:>12}: {s['ok']}/{s['requests']} ok, cached fraction {s['prefix_hit_rate_usage']:.3f}, "
                      f"ttft p50 {s['ttft_p50_s'] * 1000:.0f} ms p99 {s['ttft_p99_s'] * 1000:.0f} ms, "
                      f"{s['output_tokens_per_s']:.1f} output tok/s, placement hits {hits:.0f}", flush=True)
            if args.event_streams:
                vocab = nodes[0].stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).vocab_size
                router = start_router(nodes, "kv_aware", model=MODEL, log=base / "router-events.log")
                try:
                    before = [_event_counters(node) for node in nodes]
                    rss0 = rss_kib(router.proc.pid)
                    s = _drive(router.url, args, ["--concurrency", str(args.event_streams), "--num-requests",
                                                  str(2 * args.event_streams), "--prompt-len", "128", "--vocab-size", str(vocab),
                                                  "--output-len", "64", "--seed", "7"])
                    after = [_event_counters(node) for node in nodes]
                    rss1 = rss_kib(router.proc.pid)
                finally:
                    stop_router(router)
                for name, b, a in zip("ab", before, after, strict=True):
                    rate = {"messages_per_s": (a[0] - b[0]) / s["wall_s"], "blocks_per_s": (a[1] - b[1]) / s["wall_s"]}
                    out["events"][name] = rate
                    print(f"events node {name} at {args.event_streams} streams: {rate['messages_per_s']:.1f} "
                          f"messages/s, {rate['blocks_per_s']:.1f} blocks/s "
                          f"({s['output_tokens_per_s']:.1f} output tok/s through the router)", flush=True)
                blocks = sum(a[2] - b[2] for a, b in zip(after, before, strict=True))
                out["router_rss_growth_bytes_per_block"] = (rss1 - rss0) * 1024 / blocks if blocks else None
                print(f"router RSS {rss0 / 1024:.1f} -> {rss1 / 1024:.1f} MiB over {blocks:.0f} blocks stored"
                      f": {(rss1 - rss0) * 1024 / max(blocks, 1):.0f} B per block", flush=True)
        finally:
            for node in nodes:
                stop_serve(node)
    print(f"cpu flags: {out['cpu_flags']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
