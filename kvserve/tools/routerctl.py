"""kvserve nodes behind a real vllm-router, run from a script or a test: start the router in
front of `servectl` services, read its Prometheus counters, kill a node the hard way, and
build the shared-prefix workload that shows what KV-aware routing is worth.

`start_router` runs `vllm-router` (PyPI `vllm-router`, pinned in the dev dependencies) on a
free port with the given policy; with `kv_aware` every node's memsvc KV-event sockets are
given as static sources (../shared/ROUTER.md, docs/scaling.md). `prefix_prompts` writes the
rows of `kvserve bench --prompts-file`: `n_prefixes` long shared prefixes, each asked
`questions` short questions. Used by tests/serve/test_router.py and bench/scaleout.py.
Knows processes, HTTP and the router's flags; nothing of kvserve's internals.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvserve.tools.servectl import Service, children_of, free_block, stop_process

POLICIES = ("kv_aware", "cache_aware", "round_robin")
WORDS = ("alpha bravo cedar delta ember fjord garnet harbor indigo juniper kestrel lumen meadow "
         "nectar onyx prism quartz raven sierra tundra umber velvet willow xenon yarrow zephyr").split()


@dataclass
class Router:
    """One running vllm-router."""

    proc: subprocess.Popen
    port: int
    metrics_port: int
    policy: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples of counter or gauge `name` whose labels include `labels`
        (0 when the router has not counted it yet: its counters appear once incremented)."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                   if sample.name == name and labels.items() <= sample.labels.items())


def start_router(nodes: list[Service], policy: str, *, model: str, block_size: int = 16,
                 discover: bool = False, log: Path | None = None, ready_s: float = 60.0) -> Router:
    """Start vllm-router in front of `nodes` (their OpenAI HTTP faces) and wait until it
    answers GET /readiness. Health is checked every second and one failure marks a node
    down, so that a dead node is skipped within seconds (the router's defaults take ~3 min).
    kv_aware: the nodes' event sockets are given as static sources, or with `discover` the
    router finds them itself (GET /get_server_info and /kv_event_sources, as under
    Kubernetes service discovery)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    port, metrics = free_block(1), free_block(1)
    urls = [node.url for node in nodes]
    argv = [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *urls, "--policy", policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics),
            "--worker-startup-check-interval", "1", "--health-check-interval-secs", "1",
            "--health-check-timeout-secs", "2", "--health-failure-threshold", "1",
            "--health-success-threshold", "1", "--log-level", "warning"]
    if policy == "kv_aware" and not discover:
        for node, url in zip(nodes, urls, strict=True):
            if node.kv_events is None:
                raise ValueError(f"{url}: started without KV events (start_serve(kv_events=True))")
            argv += ["--kv-event-source", f"{url}={node.kv_events[0]}",
                     "--kv-event-replay-source", f"{url}={node.kv_events[1]}"]
        argv += ["--kv-event-block-size", str(block_size), "--kv-event-model", model]
    stderr = open(log, "a") if log is not None else subprocess.DEVNULL
    proc = subprocess.Popen(argv, stdout=stderr, stderr=stderr, start_new_session=True)
    if log is not None:
        stderr.close()
    router = Router(proc, port, metrics, policy)
    deadline = time.monotonic() + ready_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm-router exited with {proc.returncode} before it was ready"
                               + (f" (log: {log})" if log else ""))
        try:
            if urllib.request.urlopen(f"{router.url}/readiness", timeout=2).status == 200:
                return router
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    stop_router(router)
    raise RuntimeError(f"vllm-router not ready within {ready_s} s")


def stop_router(router: Router) -> int:
    return stop_process(router.proc)


def kill_node(node: Service) -> None:
    """kill -9 a whole node at once: `kvserve serve` and every child (each runs in its own
    session), as a host that loses power would."""
    pids = [node.proc.pid, *children_of(node.proc.pid)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    node.proc.wait(10)
    for pid in pids[1:]:
        for _ in range(100):  # reaped by init: wait until they are gone
            if not Path(f"/proc/{pid}").exists() or "zombie" in _state(pid):
                break
            time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:", 1)[1].splitlines()[0].lower()
    except (OSError, IndexError):
        return "zombie"


def prefix_prompts(path: Path, *, n_prefixes: int, questions: int, prefix_words: int, max_new_tokens: int,
                   seed: int = 0) -> list[int]:
    """Write `n_prefixes` × `questions` rows of `kvserve bench --prompts-file` to `path`: each
    prompt is a long shared prefix (`prefix_words` random words, distinct per prefix) and a
    short question. The first pass asks each prefix once; the rest are shuffled. Returns the
    prefix index of every row, in order."""
    rng = random.Random(seed)
    prefixes = [f"Document {p}: " + " ".join(rng.choice(WORDS) for _ in range(prefix_words))
                for p in range(n_prefixes)]
    rest = [p for p in range(n_prefixes) for _ in range(questions - 1)]
    rng.shuffle(rest)
    order = list(range(n_prefixes)) + rest
    with open(path, "w") as f:
        for i, p in enumerate(order):
            question = f"\nQ{i}: after {rng.choice(WORDS)}?"
            f.write(json.dumps({"prompt": prefixes[p] + question, "max_new_tokens": max_new_tokens}) + "\n")
    return order
