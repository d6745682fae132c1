"""Two real `kvserve serve` nodes behind the real vllm-router (issue 17): with `kv_aware`
the router reads both memsvcs' KV-cache events (from static sources, and again with a new
router that discovers them) and sends each request to the node that holds its prefix;
with `round_robin` (same nodes, a fresh set of prefixes per phase) it does not.
The pools are sized so that one node cannot hold every prefix but two can. Then one node
is killed (kill -9 of serve and all its children) and the router must keep answering.

The nodes serve the tiny byte-tokenizer model (one token per byte), so a prefix of 44 words
is ~410 tokens and a question ~15."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvserve.tools import bench
from kvserve.tools.bench_report import summarize
from kvserve.tools.routerctl import Router, kill_node, prefix_prompts, start_router, stop_router
from tests.faults.harness import Service, start_serve, stop_serve
from tests.runner.runner_procs import sharp_tiny_dir

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

N_PREFIXES, QUESTIONS, PREFIX_WORDS = 8, 10, 56
POOL_TOKENS = 2560  # one node holds ~6 of the 8 prefixes (~430 tokens each), two hold all
MODEL = "tiny"


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Service]]:
    tiny_model = sharp_tiny_dir(tmp_path_factory)
    base = tmp_path_factory.mktemp("router")
    started: list[Service] = []
    try:
        for name in ("a", "b"):
            started.append(start_serve(base / f"rt-{name}", tiny_model, "--kv-tokens", str(POOL_TOKENS),
                                       "--served-model-name", MODEL, http=True, kv_events=True,
                                       log=base / f"serve-{name}.log"))
        yield started
    finally:
        for node in started:
            if node.proc.poll() is None:
                assert stop_serve(node) == 0


def _run(router: Router, prompts: Path, n: int) -> tuple[list[bench.Record], dict]:
    args = bench.build_parser().parse_args([
        "--api", "openai", "--url", router.url, "--model", MODEL, "--prompts-file", str(prompts),
        "--num-requests", str(n), "--concurrency", "4", "--request-timeout", "120", "--quiet"])
    records, wall, _ = asyncio.run(bench.run(args))
    return records, summarize(records, wall, None)


PHASES = (("round_robin", False), ("kv_aware", False), ("kv_aware", True))  # (policy, discover)


def test_kv_aware_routing_follows_the_cache_and_survives_a_dead_node(nodes: list[Service], tmp_path: Path) -> None:
    n = N_PREFIXES * QUESTIONS
    sizes: list[int] = []  # prompt tokens: the sizing this test relies on is checked on them
    fractions = {}
    router = None
    for seed, (policy, discover) in enumerate(PHASES):
        name = policy + (" (discovered)" if discover else "")
        prompts = tmp_path / f"{seed}.jsonl"
        prefix_prompts(prompts, n_prefixes=N_PREFIXES, questions=QUESTIONS, prefix_words=PREFIX_WORDS,
                       max_new_tokens=4, seed=seed)  # a fresh set of prefixes per phase
        if router is not None:
            stop_router(router)
        # kv_aware reads the events from static sources, or finds them through GET
        # /get_server_info and /kv_event_sources (the Kubernetes manifests' way)
        router = start_router(nodes, policy, model=MODEL, discover=discover, log=tmp_path / f"router-{seed}.log")
        records, summary = _run(router, prompts, n)
        assert summary["ok"] == n, summary["errors"]
        sizes += [r.prompt_tokens for r in records]
        fractions[name] = summary["prefix_hit_rate_usage"]
        if policy == "kv_aware":
            hits = router.metric("vllm_router_kv_placement_lookups_total", result="hit")
            print(f"{name} placement hits: {hits:.0f} of {n} requests")
            # every request after a prefix's first is a placement hit when events flow
            assert hits >= N_PREFIXES * (QUESTIONS - 1) * 0.8, (name, hits)
    assert router is not None
    # the premise: no node can hold all 8 prefixes, two can (a question is < 20 tokens of a prompt)
    assert N_PREFIXES * (min(sizes) - 20) > POOL_TOKENS and 2 * POOL_TOKENS > N_PREFIXES * max(sizes)
    assert min(sizes) - 20 >= 256
    print(f"cached-token fractions: {fractions} (prompts of {min(sizes)}-{max(sizes)} tokens, pools of {POOL_TOKENS})")
    for name in ("kv_aware", "kv_aware (discovered)"):
        assert fractions[name] >= 0.7, fractions
        assert fractions[name] >= fractions["round_robin"] + 0.15, fractions

    # a node dies: every request through the router goes on succeeding, from within 15 s
    try:
        prompts = (tmp_path / "2.jsonl").read_text().splitlines()
        kill_node(nodes[0])
        killed = time.monotonic()
        answers = []
        with httpx.Client(timeout=60, trust_env=False) as client:
            for i in range(2 * N_PREFIXES):
                body = json.loads(prompts[i])
                resp = client.post(f"{router.url}/v1/completions",
                                   json={"model": MODEL, "prompt": body["prompt"], "max_tokens": 4})
                answers.append((round(time.monotonic() - killed, 2), resp.status_code))
        print(f"after kill -9 of a node: (seconds since the kill, status) {answers}")
        assert answers[0][0] <= 15.0, answers
        assert all(code == 200 for _, code in answers), answers
        assert router.proc.poll() is None
    finally:
        stop_router(router)
