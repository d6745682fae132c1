"""Output tokens/s of one `kvserve serve` over its OpenAI HTTP face and over gRPC, in one run.

    .venv/bin/python bench/http_vs_grpc.py [--concurrency 32] [--requests 64] [--rounds 2]

Starts `kvserve serve` (the embedded default model, serve's default device and dtype, the
HTTP face on a free port), warms it up, then drives it with `kvserve bench` in rounds: each
round runs the gRPC client and the OpenAI client (streaming /v1/completions) once, in
alternating order, at --concurrency streams with the same workload shape (random prompts of
--prompt-len token ids, --output-len new tokens forced with ignore_eos). Every run has a
seed of its own, so no run hits the prefix cache of another. Prints each run, the output
tokens/s of each face over all its runs, the ratio HTTP/gRPC (the goal: >= 0.95), and the
CPU's flags. Beside each face: the CPU time per output token spent by the frontend, the
runner and the benchmark client (all share this machine's cores), from /proc and
getrusage, which shows where a face's extra cost lies.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from e2e_throughput import cpu_flags

from kvserve.tools.servectl import start_serve, stop_serve
from kvserve.v1 import generator_pb2 as pb

GOAL = 0.95


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _client_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _bench(api_args: list[str], out: Path, seed: int, args: argparse.Namespace, requests: int) -> dict:
    subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "bench", *api_args, "--concurrency", str(args.concurrency),
         "--num-requests", str(requests), "--prompt-len", str(args.prompt_len), "--output-len",
         str(args.output_len), "--ignore-eos", "--quiet", "--seed", str(seed), "--json", str(out)],
        check=True, stdout=subprocess.DEVNULL,
    )
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=64, help="requests per run")
    p.add_argument("--rounds", type=int, default=2, help="runs of each face")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--json", help="write every run's summary here")
    args = p.parse_args(argv)
    totals = {"grpc": [0, 0.0], "openai": [0, 0.0]}  # output tokens, seconds
    cpu = {api: {"frontend": 0.0, "runner": 0.0, "client": 0.0} for api in totals}  # CPU seconds
    runs = []
    with tempfile.TemporaryDirectory(prefix="kvs-http-") as tmp:
        svc = start_serve(Path(tmp) / "run", None, dtype=None, device=None, http=True)
        faces = {"grpc": ["--address", f"127.0.0.1:{svc.port}"],
                 "openai": ["--api", "openai", "--url", svc.url]}
        try:
            # the vocabulary of both clients: the served model's, so both draw the same ids
            vocab = str(svc.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).vocab_size)
            faces = {api: [*a, "--vocab-size", vocab] for api, a in faces.items()}
            _bench(faces["grpc"], Path(tmp) / "warm.json", 999, args, max(8, args.concurrency))
            pids = svc.pids()
            seed = 1000
            for r in range(args.rounds):
                order = ("grpc", "openai") if r % 2 == 0 else ("openai", "grpc")
                for api in order:
                    seed += 1
                    before = {"frontend": _cpu_s(pids["frontend"]), "runner": _cpu_s(pids["runner"]),
                              "client": _client_cpu_s()}
                    res = _bench(faces[api], Path(tmp) / f"{api}-{r}.json", seed, args, args.requests)
                    cpu[api]["frontend"] += _cpu_s(pids["frontend"]) - before["frontend"]
                    cpu[api]["runner"] += _cpu_s(pids["runner"]) - before["runner"]
                    cpu[api]["client"] += _client_cpu_s() - before["client"]
                    s = res["summary"]
                    tokens = sum(rec["output_tokens"] for rec in res["records"])
                    totals[api][0] += tokens
                    totals[api][1] += s["wall_s"]
                    runs.append({"api": api, "round": r, "seed": seed, **s})
                    print(f"round {r} {api:>6}: {s['ok']}/{s['requests']} ok, {s['output_tokens_per_s']:.1f} "
                          f"output tok/s, ttft p50 {s['ttft_p50_s'] * 1000:.0f} ms, "
                          f"itl p50 {s['itl_p50_s'] * 1000:.1f} ms", flush=True)
        finally:
            rc = stop_serve(svc)
    rate = {api: t / s if s else 0.0 for api, (t, s) in totals.items()}
    ratio = rate["openai"] / rate["grpc"] if rate["grpc"] else 0.0
    per_token = {api: {who: 1000 * sec / totals[api][0] if totals[api][0] else 0.0 for who, sec in parts.items()}
                 for api, parts in cpu.items()}
    for api, parts in per_token.items():
        print(f"{api:>6} CPU ms per output token: " + ", ".join(f"{who} {ms:.2f}" for who, ms in parts.items()))
    print(f"concurrency={args.concurrency} prompt={args.prompt_len} output={args.output_len} "
          f"runs={args.rounds} per face: gRPC {rate['grpc']:.1f} tok/s, HTTP {rate['openai']:.1f} tok/s, "
          f"HTTP/gRPC = {ratio:.3f} (goal >= {GOAL})  cpu flags: {cpu_flags()}  serve rc={rc}  "
          f"threads={os.cpu_count()}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"runs": runs, "rate": rate, "ratio": ratio, "cpu_ms_per_token": per_token}, indent=1))
    ok = all(run["ok"] == run["requests"] for run in runs)
    return 0 if ok and rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
