"""`kvserve serve` on a GPU, end to end: stages 2 and 4 of `make gpu-check` (bench/gpu_check.sh).

    python bench/gpu_serve.py correctness --device cuda --out DIR
    python bench/gpu_serve.py throughput --out DIR

correctness: a tiny Llama-shaped model made on the spot (fixed seed, random weights, an HF
safetensors folder) served by `kvserve serve --device DEVICE --runners 2` in float32:
memsvc allocates the pool on DEVICE and both runners map it (CUDA IPC on a GPU). 16
concurrent greedy Generate streams must equal, token for token, HF transformers on DEVICE
and, on a GPU, the same service with `--device cpu`. Then one runner is killed (-9) while
all 16 stream: exactly its streams fail UNAVAILABLE, the others finish; the restarted runner
serves prompts whose shared prefix was cached before the kill, with cache hits and the HF
tokens; after shutdown the GPU's used memory is back to where it was. `--device cpu` is the
dry run CI does (tests/ops/test_gpu_check.py).

throughput (CUDA only): random bf16 weights in Llama-3.1-8B's shape, written on the spot;
`kvserve bench` at 1, 64 and 256 streams, 512-token prompts (token ids), 256 new tokens
forced: output tokens/s, TTFT p50, inter-token p50, and the frontend's and runner's CPU per
streamed token; then the bare static torch loop (kvserve.tools.staticloop) on the same
weights at the same batch sizes.

Each stage writes DIR/<stage>.json and prints what it checks; the exit status is 0 only
when every check held.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch

from kvserve.tools.servectl import LeftBehind, Service, children_of, start_serve, stop_serve
from kvserve.tools.tinymodel import LLAMA_3_1_8B, LlamaShape, write_random_llama, write_tiny_model
from kvserve.v1 import generator_pb2 as pb

NEW = 32  # greedy tokens per stream in the equality check
LONG = 400  # tokens of the streams that are running when a runner is killed
STREAMS = 16
PREFIX = 96  # tokens of the prefix cached before the kill


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Checks:
    """Named pass/fail results, printed as they come."""

    def __init__(self) -> None:
        self.results: dict[str, dict] = {}

    def check(self, name: str, ok: bool, detail: str) -> bool:
        self.results[name] = {"ok": bool(ok), "detail": detail}
        log(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")
        return ok

    @property
    def ok(self) -> bool:
        return bool(self.results) and all(r["ok"] for r in self.results.values())


# ---------------------------------------------------------------- the reference and the streams

def hf_greedy(model_dir: Path, prompts: list[list[int]], new: int, device: str) -> list[list[int]]:
    """Greedy continuation of each prompt by HF transformers in float32 on `device` (EOS ignored)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            past, got = None, []
            for _ in range(new):
                res = model(input_ids=ids, past_key_values=past, use_cache=True)
                past = res.past_key_values
                tok = int(res.logits[0, -1].argmax())
                got.append(tok)
                ids = torch.tensor([[tok]], device=device)
            out.append(got)
    del model
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return out


def greedy(ids: list[int], new: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
        temperature=0.0, max_new_tokens=new, ignore_eos=True))


@dataclass
class Stream:
    """One Generate stream run on a thread."""

    tokens: list[int] = field(default_factory=list)
    code: grpc.StatusCode | None = None
    cached: int = -1
    first: threading.Event = field(default_factory=threading.Event)


def run_streams(svc: Service, prompts: list[list[int]], new: int) -> tuple[list[Stream], list[threading.Thread]]:
    """Start one Generate stream per prompt, each on its own thread."""
    streams = [Stream() for _ in prompts]

    def one(s: Stream, ids: list[int]) -> None:
        try:
            for msg in svc.stub.Generate(greedy(ids, new), timeout=300):
                s.tokens.extend(msg.token_ids)
                s.first.set()
                if msg.finish_reason:
                    s.cached = msg.usage.cached_tokens
            s.code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            s.code = exc.code()
        s.first.set()

    threads = [threading.Thread(target=one, args=(s, p), daemon=True) for s, p in zip(streams, prompts, strict=True)]
    for t in threads:
        t.start()
    return streams, threads


def generate_all(svc: Service, prompts: list[list[int]], new: int) -> list[Stream]:
    streams, threads = run_streams(svc, prompts, new)
    for t in threads:
        t.join(300)
    return streams


def first_divergence(got: list[int], want: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))


def compare(checks: Checks, name: str, streams: list[Stream], reference: list[list[int]]) -> None:
    bad = [(i, first_divergence(s.tokens, r)) for i, (s, r) in enumerate(zip(streams, reference, strict=True))
           if s.code != grpc.StatusCode.OK or s.tokens != r]
    checks.check(name, not bad, f"{len(streams) - len(bad)} of {len(streams)} streams equal token for token"
                 + (f"; differing (stream, first divergence): {bad}" if bad else ""))


def runner_pids(svc: Service) -> dict[str, int]:
    """{runner id: pid} of the live runners."""
    out = {}
    for pid, cmd in children_of(svc.proc.pid).items():
        if "kvserve.cli runner " in cmd and "--runner-id=" in cmd:
            out[cmd.split("--runner-id=", 1)[1].split()[0]] = pid
    return out


def live_runners(svc: Service) -> dict[str, pb.RunnerLoad]:
    try:
        report = svc.stub.GetLoad(pb.GetLoadRequest(), timeout=5)
    except grpc.RpcError:
        return {}
    return {r.runner_id: r for r in report.runners if r.live}


def wait_for(pred, timeout: float, step: float = 0.1) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return bool(pred())


def gpu_used_mib() -> float:
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**20


def runner_info(svc: Service, index: int) -> str:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{svc.metrics_base + 2 + index}/metrics", timeout=5).read().decode()
    return next((ln for ln in text.splitlines() if ln.startswith("kvserve_runner_info")), "")


def stop(checks: Checks, svc: Service, what: str = "") -> None:
    """Stop serve; a check that it exits 0 and leaves nothing behind."""
    try:
        code = stop_serve(svc)
    except LeftBehind as exc:
        checks.check(f"serve {what}stops cleanly", False, str(exc))
        return
    checks.check(f"serve {what}stops cleanly", code == 0, f"exit status {code}, nothing left behind")


# ---------------------------------------------------------------- stage 2

def correctness(device: str, out: Path, work: Path, serve_log: Path) -> Checks:
    checks = Checks()
    cuda = device.startswith("cuda")
    model = write_tiny_model(work / "tiny", seed=1234, hidden_size=256, intermediate_size=512,
                             num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64)
    rng = random.Random(1234)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(8, 64))] for _ in range(STREAMS)]
    prefix = [rng.randrange(256) for _ in range(PREFIX)]
    shared = [prefix + [rng.randrange(256) for _ in range(rng.randint(4, 12))] for _ in range(9)]
    long_prompts = [[rng.randrange(256) for _ in range(rng.randint(16, 48))] for _ in range(STREAMS)]
    t0 = time.monotonic()
    reference = hf_greedy(model, prompts + shared, NEW, device)
    ref, ref_shared = reference[:STREAMS], reference[STREAMS:]
    log(f"HF transformers reference on {device}: {len(reference)} prompts x {NEW} tokens "
        f"in {time.monotonic() - t0:.1f} s")
    before = gpu_used_mib() if cuda else 0.0

    svc = start_serve(work / "run-a", model, "--runners", "2", dtype="float32", device=device,
                      log=serve_log, ready_s=300)
    try:
        checks.check("two runners live", wait_for(lambda: len(live_runners(svc)) == 2, 120),
                     f"runners live: {sorted(live_runners(svc))}")
        infos = [runner_info(svc, i) for i in range(2)]
        checks.check("runners on the device", all(f'device="{device}' in i for i in infos), " | ".join(infos))
        if cuda:
            pool = gpu_used_mib() - before
            checks.check("pool and runners on the GPU", pool > 0, f"GPU memory used by the service: {pool:.0f} MiB")
        t0 = time.monotonic()
        streams = generate_all(svc, prompts, NEW)
        log(f"{STREAMS} concurrent streams x {NEW} tokens in {time.monotonic() - t0:.2f} s")
        compare(checks, f"kvserve --device {device} --runners 2 == HF on {device}", streams, ref)
        warm = generate_all(svc, shared[:1], NEW)
        compare(checks, "the prefix prompt before the kill", warm, ref_shared[:1])

        # kill -9 of one runner while all 16 stream
        pids = runner_pids(svc)
        streams, threads = run_streams(svc, long_prompts, LONG)
        all_streaming = wait_for(lambda: all(s.first.is_set() for s in streams), 120)
        # the runners' load reports catch up with the 16 streams (they come with the steps)
        wait_for(lambda: sum(r.running for r in live_runners(svc).values()) == STREAMS, 30)
        loads = live_runners(svc)
        victim_id = "runner-0"
        victim = pids[victim_id]
        os.kill(victim, signal.SIGSTOP)  # nothing of the victim's can finish between count and kill
        held = live_runners(svc).get(victim_id)
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        for t in threads:
            t.join(300)
        failed = [i for i, s in enumerate(streams) if s.code == grpc.StatusCode.UNAVAILABLE]
        finished = [i for i, s in enumerate(streams) if s.code == grpc.StatusCode.OK and len(s.tokens) == LONG]
        running = held.running if held is not None else -1
        checks.check("all 16 streaming on both runners before the kill",
                     all_streaming and all(r.running > 0 for r in loads.values()) and len(loads) == 2,
                     f"running per runner: { {k: v.running for k, v in loads.items()} }")
        checks.check("exactly the killed runner's streams fail UNAVAILABLE",
                     len(failed) == running and len(failed) + len(finished) == STREAMS and running > 0,
                     f"{running} running on {victim_id} at the kill; {len(failed)} UNAVAILABLE, "
                     f"{len(finished)} finished all {LONG} tokens; codes "
                     f"{sorted({str(s.code) for s in streams})}")
        restarted = wait_for(lambda: len(live_runners(svc)) == 2
                             and runner_pids(svc).get(victim_id) not in (None, victim), 180)
        checks.check("the killed runner is restarted", restarted,
                     f"{victim_id} pid {victim} -> {runner_pids(svc).get(victim_id)}, live again "
                     f"{time.monotonic() - killed_at:.1f} s after the kill")
        calls = "kvserve_runner_memsvc_calls_total"
        before_calls = svc.metric(2, calls)
        again = generate_all(svc, shared[1:], NEW)
        served = svc.metric(2, calls) - before_calls
        hits = [s.cached for s in again]
        compare(checks, "after the restart, prompts on the cached prefix == HF", again, ref_shared[1:])
        checks.check("the prefix cached before the kill is hit", all(h >= PREFIX for h in hits),
                     f"cached_tokens per request {hits} (the prefix is {PREFIX} tokens)")
        checks.check("the restarted runner served some of them", served > 0,
                     f"{served:.0f} step round trips to memsvc from the restarted {victim_id}")
    finally:
        stop(checks, svc)
    if cuda:
        settled = wait_for(lambda: gpu_used_mib() - before <= 16, 20, 0.5)
        after = gpu_used_mib()
        checks.check("GPU memory back after shutdown", settled,
                     f"used before serve {before:.0f} MiB, after shutdown {after:.0f} MiB")
        svc = start_serve(work / "run-cpu", model, "--runners", "1", dtype="float32", device="cpu",
                          log=serve_log, ready_s=300)
        try:
            compare(checks, "kvserve --device cpu == HF on cuda", generate_all(svc, prompts, NEW), ref)
        finally:
            stop(checks, svc, "--device cpu ")
    return checks


# ---------------------------------------------------------------- stage 4

def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_level(svc: Service, streams: int, requests: int, out: Path, prompt: int, new: int,
                plot: Path | None = None) -> dict:
    js = out / f"bench_{streams}.json"
    cmd = [sys.executable, "-m", "kvserve.cli", "bench", "--address", f"127.0.0.1:{svc.port}",
           "--concurrency", str(streams), "--num-requests", str(requests), "--prompt-len", str(prompt),
           "--output-len", str(new), "--quiet", "--json", str(js), *(["--plot", str(plot)] if plot else [])]
    pids = svc.pids()
    cpu0 = {r: cpu_seconds(p) for r, p in pids.items()}
    subprocess.run(cmd, check=False, timeout=400)
    cpu1 = {r: cpu_seconds(p) for r, p in pids.items()}
    summary = json.loads(js.read_text())["summary"]
    js.unlink()
    tokens = max(summary["output_tokens"], 1)
    summary["cpu_ms_per_token"] = {r: 1000 * (cpu1[r] - cpu0[r]) / tokens for r in pids}
    log(f"{streams:>4} streams: {summary['output_tokens_per_s']:.0f} tok/s, TTFT p50 "
        f"{summary['ttft_p50_s'] * 1e3:.0f} ms, inter-token p50 {summary['itl_p50_s'] * 1e3:.1f} ms, "
        f"{summary['ok']}/{summary['requests']} ok, CPU ms/token {summary['cpu_ms_per_token']}")
    return summary


def throughput(out: Path, work: Path, serve_log: Path, levels: list[int], prompt: int, new: int,
               device: str = "cuda", shape: LlamaShape = LLAMA_3_1_8B) -> tuple[Checks, dict]:
    """`device` and `shape` other than cuda and 8B only to try the script itself on a CPU."""
    from kvserve.model.weights import load_model
    from kvserve.tools.staticloop import static_generate

    checks = Checks()
    t0 = time.monotonic()
    model = write_random_llama(work / "llama", shape, dtype=torch.bfloat16, device=device)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    log(f"random {shape} bf16 weights written in {time.monotonic() - t0:.1f} s")
    top = max(levels)
    cfg = work / "gpu.toml"
    cfg.write_text(f"[memsvc]\nkv_tokens = {top * (prompt + new) + 8192}\nmax_reqs = {top + 8}\n"
                   f"[runner]\nmax_running = {top}\nmax_batch_tokens = 16384\nchunk_size = 4096\n")
    t0 = time.monotonic()
    svc = start_serve(work / "run-8b", model, "--runners", "1", "--config", str(cfg),
                      dtype="bfloat16", device=device, log=serve_log, ready_s=600)
    report: dict = {"model": f"{shape}, random bf16", "prompt": prompt, "new": new, "serve": {}}
    try:
        log(f"serve ready in {time.monotonic() - t0:.1f} s")
        bench_level(svc, 4, 4, out, 64, 16)  # compile and warm up
        for n in levels:
            s = bench_level(svc, n, n if n > 1 else 2, out, prompt, new,
                            plot=out / f"serve_{n}.png" if n == top else None)
            report["serve"][n] = {k: s[k] for k in ("output_tokens_per_s", "ttft_p50_s", "itl_p50_s",
                                                     "ok", "requests", "errors", "cpu_ms_per_token")}
            checks.check(f"{n} streams all served", s["ok"] == s["requests"], f"{s['ok']}/{s['requests']} ok, errors {s['errors']}")
        top_run = report["serve"][top]
        front = top_run["cpu_ms_per_token"].get("frontend", float("nan"))
        busy = front * top_run["output_tokens_per_s"] / 1000  # cores the frontend kept busy
        checks.check(f"the frontend is not the bound at {top} streams", busy < 0.5,
                     f"frontend CPU {front:.3f} ms per streamed token at "
                     f"{top_run['output_tokens_per_s']:.0f} tok/s: {busy:.2f} of one core")
    finally:
        stop(checks, svc)
    loaded = load_model(str(model), dtype=torch.bfloat16, device=device).model
    report["static"] = {}
    gen = torch.Generator().manual_seed(0)
    static_generate(loaded, torch.randint(0, shape.vocab, (2, 64), generator=gen), 4)  # warm up
    for n in levels:
        run = static_generate(loaded, torch.randint(0, shape.vocab, (n, prompt), generator=gen), new)
        report["static"][n] = {"output_tokens_per_s": run.tokens_per_s, "prefill_s": run.prefill_s,
                               "decode_tokens_per_s": run.decode_tokens_per_s}
        log(f"{n:>4} bare torch loop: {run.tokens_per_s:.0f} tok/s (prefill {run.prefill_s * 1e3:.0f} ms, "
            f"decode {run.decode_tokens_per_s:.0f} tok/s)")
    for n in levels:
        ratio = report["serve"][n]["output_tokens_per_s"] / report["static"][n]["output_tokens_per_s"]
        report.setdefault("serve_over_static", {})[n] = ratio
        log(f"{n:>4} streams: kvserve / bare loop = {ratio:.2f}")
    return checks, report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=("correctness", "throughput"))
    parser.add_argument("--device", default="cuda", help="cuda or cpu (the dry run; correctness only)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/kvserve-gpu"))
    parser.add_argument("--levels", default="1,64,256", help="throughput: concurrent streams")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_serve: no CUDA device (use --device cpu for the dry run)", file=sys.stderr)
        return 2
    if args.stage == "throughput" and not args.device.startswith("cuda"):
        print("gpu_serve: the throughput stage needs CUDA", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    serve_log = args.out / "serve.log"
    with tempfile.TemporaryDirectory(prefix="kvserve-gpu-") as tmp:
        if args.stage == "correctness":
            checks, report = correctness(args.device, args.out, Path(tmp), serve_log), {}
        else:
            levels = [int(x) for x in args.levels.split(",")]
            checks, report = throughput(args.out, Path(tmp), serve_log, levels, args.prompt_len, args.output_len)
    result = {"stage": args.stage, "device": args.device, "ok": checks.ok, "checks": checks.results, **report}
    (args.out / f"{args.stage}.json").write_text(json.dumps(result, indent=1))
    log(f"{args.stage}: {'all checks passed' if checks.ok else 'FAILED'}")
    return 0 if checks.ok else 1


if __name__ == "__main__":
    sys.exit(main())
