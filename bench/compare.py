"""`make bench`: kvserve beside its peers on the same model, prompts and machine, one run.

Peers: Hugging Face transformers `generate` in static batches (bench/peer_hf.py, in the
project's venv), llama-cpp-python on the same GGUF (bench/peer_llamacpp.py, in the venv
bench/peers.py builds under .peers/ on first use, for this CPU's AVX2 / AVX-512 flags, without
the AMX path), and kvserve itself through gRPC (a real `kvserve serve`) at several
concurrencies. `--dtype auto` (the default) is what `kvserve serve` picks for the CPU: bfloat16
where it has native bf16, else float32; HF runs in the same dtype.

Two workloads: fixed (prompt 128, 128 new tokens) and mixed (64 requests, prompts
32-512, outputs 16-256, seeded uniform). Every request generates exactly its
max_new_tokens (EOS suppressed everywhere). Prints a table and, with --docs, writes it
between the bench markers of docs/benchmarks.md with the date, the machine and the command.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # peers.py: the llama.cpp build and the CPU's flags

import peers  # noqa: E402

from kvserve.model.files import resolve_model  # noqa: E402
from kvserve.tools.bench_grpc import run_one  # noqa: E402
from kvserve.tools.bench_report import Record, percentile  # noqa: E402

BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


def workloads(vocab: int, seed: int, fixed_n: dict[int, int], mixed_n: int) -> dict[str, list[dict]]:
    """Seeded request lists: token ids drawn from the bulk of the vocabulary."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(1000, vocab) for _ in range(n)]  # noqa: E731
    fixed_len = max(fixed_n.values())
    fixed = [{"token_ids": ids(128), "max_new_tokens": 128} for _ in range(fixed_len)]
    mixed = [{"token_ids": ids(rng.randint(32, 512)), "max_new_tokens": rng.randint(16, 256)}
             for _ in range(mixed_n)]
    return {"fixed": fixed, "mixed": mixed}


def figures(result: dict) -> dict:
    recs = result["records"]
    tokens = sum(r["output_tokens"] for r in recs)
    ttft = [r["first_token"] - r["start"] for r in recs if r.get("first_token") is not None]
    return {"tok_s": tokens / result["wall_s"], "ttft_p50": percentile(ttft, 0.5),
            "ttft_p99": percentile(ttft, 0.99), "peak_mib": result.get("peak_rss_mib", float("nan")),
            "requests": len(recs), "wall_s": result["wall_s"]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree_peak_mib(pid: int) -> float:
    """Sum of VmHWM over a process's descendants (shared KV pages count in each mapper)."""
    total = 0
    try:
        children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                                  text=True).stdout.split()
    except OSError:
        children = []
    for cpid in children:
        try:
            status = Path(f"/proc/{cpid}/status").read_text()
        except OSError:
            continue
        m = re.search(r"VmHWM:\s+(\d+) kB", status)
        total += int(m.group(1)) if m else 0
    return total / 1024


class KvserveServer:
    """A real `kvserve serve` for the run's duration."""

    def __init__(self, dtype: str, extra: list[str]) -> None:
        self.port = _free_port()
        self.metrics = _free_port()
        self.tmp = tempfile.TemporaryDirectory(prefix="kvs-bench-")
        env = dict(os.environ, KVSERVE_RUNTIME_DIR=self.tmp.name, PYTHONUNBUFFERED="1")
        self.log = open(Path(self.tmp.name) / "serve.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvserve.cli", "serve", "--dtype", dtype, "--port", str(self.port),
             "--metrics-port", "0", *extra],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)

    def wait_ready(self, timeout: float = 600.0) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        end = time.time() + timeout
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while time.time() < end:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"kvserve serve exited: {Path(self.log.name).read_text()[-2000:]}")
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status == 1:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.5)
        raise TimeoutError("kvserve serve did not become ready")

    def run(self, requests: list[dict], concurrency: int) -> dict:
        return asyncio.run(self._run(requests, concurrency))

    async def _run(self, requests: list[dict], concurrency: int) -> dict:
        import grpc

        from kvserve.v1 import generator_pb2 as pb
        from kvserve.v1 import generator_pb2_grpc as pb_grpc

        records = [Record(i, len(r["token_ids"]), r["max_new_tokens"]) for i, r in enumerate(requests)]
        it = iter(range(len(requests)))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.port}") as ch:
            stub = pb_grpc.GeneratorStub(ch)
            t0 = time.perf_counter()

            async def client() -> None:
                for i in it:
                    r = requests[i]
                    req = pb.GenerateRequest(request_id=f"cmp-{concurrency}-{i}-{time.time_ns()}",
                                             token_ids=pb.TokenIds(ids=r["token_ids"]),
                                             sampling=pb.SamplingParams(max_new_tokens=r["max_new_tokens"],
                                                                        ignore_eos=True))
                    await run_one(stub, req, records[i], t0, 1800.0, ())

            await asyncio.gather(*(client() for _ in range(concurrency)))
            wall = time.perf_counter() - t0
        bad = [r.status for r in records if r.status != "OK"]
        if bad:
            raise RuntimeError(f"kvserve requests failed: {bad[:5]}")
        return {"records": [{"start": r.start, "first_token": r.first_token, "end": r.end,
                             "output_tokens": r.output_tokens} for r in records],
                "wall_s": wall, "peak_rss_mib": _tree_peak_mib(self.proc.pid)}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        self.tmp.cleanup()


def ensure_llamacpp() -> Path | None:
    """A python with llama_cpp built for this CPU (bench/peers.py's venv), or None where it
    could not be built."""
    try:
        return peers.ensure_llamacpp_server()
    except (subprocess.CalledProcessError, RuntimeError) as exc:
        print(f"llama-cpp-python: {exc}", file=sys.stderr)
        return None


def run_peer(cmd: list, spec: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        wl, out = Path(tmp) / "w.json", Path(tmp) / "r.json"
        wl.write_text(json.dumps(spec))
        subprocess.run([str(c) for c in cmd[:2]] + [str(wl), str(out)] + [str(c) for c in cmd[2:]],
                       check=True, cwd=ROOT)
        return json.loads(out.read_text())


def table(rows: list[dict]) -> str:
    head = "| workload | system | concurrency / batch | output tok/s | TTFT p50 (s) | TTFT p99 (s) | peak RSS (MiB) | kvserve ÷ this |"
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        ratio = "" if r["system"] == "kvserve" or not r.get("ratio") else f"{r['ratio']:.2f}×"
        lines.append(f"| {r['workload']} | {r['system']} | {r['conc']} | {r['tok_s']:.1f} | {r['ttft_p50']:.2f} "
                     f"| {r['ttft_p99']:.2f} | {r['peak_mib']:.0f} | {ratio} |")
    return "\n".join(lines)


DOC = ROOT / "docs" / "benchmarks.md"


def write_doc(text: str) -> None:
    body = DOC.read_text()
    if BEGIN not in body or END not in body:
        raise SystemExit(f"{DOC} has no {BEGIN} ... {END} markers")
    pre, rest = body.split(BEGIN, 1)
    _, post = rest.split(END, 1)
    DOC.write_text(f"{pre}{BEGIN}\n{text}\n{END}{post}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto: bfloat16 where the CPU has native bf16, else float32")
    p.add_argument("--concurrency", default="1,8,32", help="kvserve concurrencies (default: %(default)s)")
    p.add_argument("--peers", default="hf,llamacpp", help="peers to run beside kvserve (default: %(default)s)")
    p.add_argument("--workloads", default="fixed,mixed")
    p.add_argument("--mixed-requests", type=int, default=64)
    p.add_argument("--mixed-concurrency", default="8,32", help="kvserve concurrencies on the mixed workload")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--serve-args", default="", help="extra flags for kvserve serve")
    p.add_argument("--docs", action="store_true", help="write the table into docs/benchmarks.md")
    p.add_argument("--json", help="write raw results here")
    args = p.parse_args()
    from kvserve.config.devices import resolve_dtype

    args.dtype = resolve_dtype(args.dtype, "cpu")
    concs = [int(c) for c in args.concurrency.split(",")]
    peer_names = [x for x in args.peers.split(",") if x]
    wanted = args.workloads.split(",")
    model = resolve_model(None)
    from kvserve.model.weights import load_tokenizer

    tok = load_tokenizer(None)
    mixed_concs = [int(c) for c in args.mixed_concurrency.split(",")]
    fixed_n = {c: max(c, 8) if c > 1 else 3 for c in concs}
    wl = workloads(tok.vocab_size, 0, fixed_n, args.mixed_requests)
    base = {"model": str(model), "eos_token_id": tok.eos_token_ids[0]}
    rows: list[dict] = []
    results: dict = {}
    plan = [(w, c, (wl["fixed"][: fixed_n[c]] if w == "fixed" else wl["mixed"])) for w in wanted
            for c in (concs if w == "fixed" else mixed_concs)]

    server = KvserveServer(args.dtype, args.serve_args.split())
    try:
        server.wait_ready()
        server.run(wl["fixed"][:2], 2)  # warm-up: first-call costs stay out of the figures
        for w, c, reqs in plan:
            res = server.run(reqs, c)
            results[f"kvserve/{w}/{c}"] = res
            rows.append({"workload": w, "system": "kvserve", "conc": c, **figures(res)})
            print(table(rows[-1:]).splitlines()[-1], file=sys.stderr)
    finally:
        server.stop()

    llama_py = ensure_llamacpp() if "llamacpp" in peer_names else None
    for w, c, reqs in plan:
        kv = next(r for r in rows if r["system"] == "kvserve" and r["workload"] == w and r["conc"] == c)
        spec = dict(base, requests=reqs)
        if "hf" in peer_names:
            batch = c if w == "fixed" else 32
            if not any(r["system"] == "HF generate" and r["workload"] == w and r["conc"] == batch for r in rows):
                res = run_peer([sys.executable, ROOT / "bench" / "peer_hf.py", batch, args.dtype, args.threads], spec)
                results[f"hf/{w}/{batch}"] = res
                f = figures(res)
                rows.append({"workload": w, "system": "HF generate", "conc": batch, **f,
                             "ratio": kv["tok_s"] / f["tok_s"]})
                print(table(rows[-1:]).splitlines()[-1], file=sys.stderr)
        if llama_py is not None:
            res = run_peer([llama_py, ROOT / "bench" / "peer_llamacpp.py", c, args.threads], spec)
            results[f"llamacpp/{w}/{c}"] = res
            f = figures(res)
            rows.append({"workload": w, "system": "llama-cpp-python", "conc": c, **f,
                         "ratio": kv["tok_s"] / f["tok_s"]})
            print(table(rows[-1:]).splitlines()[-1], file=sys.stderr)
    if "llamacpp" in peer_names and llama_py is None:
        print("llama-cpp-python could not be built; its rows are missing", file=sys.stderr)

    rows.sort(key=lambda r: (r["workload"], r["conc"], r["system"] != "kvserve"))
    cpu, flags = peers.cpu_info()
    cmd = "python bench/compare.py " + " ".join(sys.argv[1:])
    text = (f"Measured {datetime.date.today().isoformat()} on {cpu}, {os.cpu_count()} "
            f"cores, flags {' '.join(flags) or 'none'}, "
            f"{args.dtype}, model SmolLM2-135M-Instruct (Q4_1 GGUF; kvserve serves it with `--quantization "
            f"auto` unless --serve-args say otherwise (int4 projections from the file's codes), HF "
            f"dequantizes it, llama.cpp runs it quantized). Command: `{cmd}`. Peak RSS of kvserve sums memsvc, "
            f"runner and frontend (the shared KV pool counts in memsvc and the runner).\n\n{table(rows)}")
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"rows": rows, "results": results}, indent=1))
    if args.docs:
        write_doc(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
