"""Serving benchmark of the runner's scheduler with the default model (issue 3), in one run.

Drives `kvserve.runner.scheduler.Scheduler` in-process against a real `kvserve memsvc`
process and compares it, in the same dtype and on the same prompts, with the bare static
torch loop (`kvserve.tools.staticloop`, via bench/model_loop.py) and HF `generate`:

1. one stream: decode tokens/s at batch 1;
2. 1, 8 and 32 concurrent requests (prompts 128 tokens, 128 new): aggregate tokens/s
   (every generated token over wall time, prefill included);
3. a mixed workload: 64 requests, prompts 32-512, max_new_tokens 16-256 (seeded uniform),
   all at once, against HF generate in static batches of 32 (each request's tokens counted
   up to its own limit);
4. a shared 512-token system prompt: time to first token with the prefix cache cold vs warm.

    .venv/bin/python bench/runner_bench.py [--dtype float32] [--no-hf] [--quick]
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_loop import make_prompts, run_hf  # noqa: E402

from kvserve.config.devices import resolve_dtype  # noqa: E402
from kvserve.kernels import get_backend  # noqa: E402
from kvserve.memsvc.client import MemClient  # noqa: E402
from kvserve.messages.frontend_runner import GenerateReq, SamplingParams  # noqa: E402
from kvserve.model.weights import load_model  # noqa: E402
from kvserve.runner.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from kvserve.tools.staticloop import static_generate  # noqa: E402


def start_memsvc(run_dir: Path, model: str | None, dtype: str, kv_tokens: int) -> tuple[subprocess.Popen, str]:
    address = f"ipc://{run_dir}/memsvc.sock"
    argv = [sys.executable, "-m", "kvserve.cli", "memsvc", "--dtype", dtype, "--kv-tokens",
            str(kv_tokens), "--max-reqs", "128", "--policy", "optimistic", "--page-size", "16",
            "--address", address, "--metrics-port", "0", "--runtime-dir", str(run_dir)]
    if model:
        argv += ["--model", model]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, KVSERVE_RUNTIME_DIR=str(run_dir)))
    assert proc.stdout is not None
    line = ""
    while "memsvc ready" not in line:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError("memsvc did not start")
    return proc, address


class Bench:
    def __init__(self, loaded: Any, client: MemClient) -> None:
        self.loaded, self.client = loaded, client
        self.n = 0

    def scheduler(self, **kw: Any) -> Scheduler:
        return Scheduler(model=self.loaded.model, mem=self.client, layout=self.client.layout,
                         backend=get_backend("torch"), eos_token_ids=self.loaded.eos_token_ids,
                         config=SchedulerConfig(**kw))

    def run(self, prompts: list[list[int]], max_new: list[int], **kw: Any) -> dict[str, Any]:
        """Generate greedily (no early stop) for every prompt at once; timings per request."""
        sched = self.scheduler(**kw)
        request_ids = []
        t0 = time.perf_counter()
        for p, m in zip(prompts, max_new, strict=True):
            self.n += 1
            request_id = f"b{self.n}"
            request_ids.append(request_id)
            sched.add(GenerateReq(request_id, p, SamplingParams(max_new_tokens=m, ignore_eos=True)))
        first: dict[str, float] = {}
        count = 0
        while sched.has_work():
            outs = sched.step()
            now = time.perf_counter()
            for o in outs:
                count += len(o.token_ids)
                first.setdefault(o.request_id, now)
        wall = time.perf_counter() - t0
        return {"wall": wall, "tokens": count, "tok_s": count / wall,
                "ttft": [first[r] - t0 for r in request_ids], "sched": sched}


def ids(tok: Any, prompts: torch.Tensor) -> list[list[int]]:
    return [row.tolist() for row in prompts]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--no-hf", action="store_true", help="skip transformers generate")
    ap.add_argument("--quick", action="store_true", help="smaller workloads (a smoke run)")
    ap.add_argument("--kv-tokens", type=int, default=65536)
    args = ap.parse_args(argv)
    dtype_name = resolve_dtype(args.dtype, "cpu")
    dtype = getattr(torch, dtype_name)
    new = 16 if args.quick else args.new_tokens
    loaded = load_model(args.model, dtype=dtype, device="cpu")
    tok = loaded.tokenizer
    print(f"model {loaded.name} dtype {dtype_name} threads {torch.get_num_threads()}", flush=True)
    static_generate(loaded.model, make_prompts(tok, 1, 16), 4)  # warm-up
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-") as tmp:
        run_dir = Path(tmp)
        run_dir.chmod(0o700)
        proc, address = start_memsvc(run_dir, args.model, dtype_name, args.kv_tokens)
        client = MemClient(address, name="bench", timeout_s=30.0)
        mc = loaded.config
        client.attach(n_layers=mc.num_layers, n_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                      dtype=dtype_name)
        try:
            bench = Bench(loaded, client)
            bench.run(ids(tok, make_prompts(tok, 2, 32)), [4, 4])  # warm-up
            print(f"\n== concurrent requests, prompts 128, {new} new (aggregate tok/s) ==")
            print("batch  kvserve  bare-loop  ratio  hf-generate   (batch 1 decode-only tok/s: kvserve / bare)")
            for b in [int(x) for x in args.batch_sizes.split(",")]:
                prompts = make_prompts(tok, b, 128)
                prompts[:, 0] = 1000 + b  # no run hits another run's cached prefix
                plist = ids(tok, prompts)
                ours = bench.run(plist, [new] * b)
                bare = static_generate(loaded.model, prompts, new)
                hf = run_hf(args.model, dtype, prompts, new) if not args.no_hf else float("nan")
                extra = ""
                if b == 1:
                    dec = (new - 1) / (ours["wall"] - ours["ttft"][0])
                    extra = f"   decode {dec:.1f} / {bare.decode_tokens_per_s:.1f} = {dec / bare.decode_tokens_per_s:.2f}x"
                print(f"{b:5d}  {ours['tok_s']:7.1f}  {bare.tokens_per_s:9.1f}  {ours['tok_s'] / bare.tokens_per_s:5.2f}"
                      f"  {hf:11.1f}{extra}", flush=True)

            n_req = 16 if args.quick else 64
            rng = random.Random(0)
            lens = [rng.randint(32, 512) for _ in range(n_req)]
            news = [rng.randint(16, 64 if args.quick else 256) for _ in range(n_req)]
            base = make_prompts(tok, 1, 600)[0].tolist()
            mixed = [[(i * 7919 + 11) % 40000] + base[i % 50: i % 50 + n - 1] for i, n in enumerate(lens)]
            print(f"\n== mixed workload: {n_req} requests, prompts 32-512, max_new 16-{max(news)} ==", flush=True)
            ours = bench.run(mixed, news)
            line = f"kvserve {ours['tokens']} tokens in {ours['wall']:.1f} s = {ours['tok_s']:.1f} tok/s"
            if not args.no_hf:
                hf_tokens, hf_wall = run_hf_static(args.model, dtype, mixed, news, 32)
                line += f"; hf static batches of 32: {hf_tokens / hf_wall:.1f} tok/s -> {ours['tok_s'] / (hf_tokens / hf_wall):.2f}x"
            print(line, f"(preemptions {ours['sched'].num_preemptions})", flush=True)

            print("\n== shared 512-token system prompt: time to first token ==", flush=True)
            system = [(7 * 1000 + 3) % 40000] + base[:511]
            q = [tok(f" Question {i}: what is {i} plus {i}?").input_ids for i in range(4)]
            cold = bench.run([system + q[0]], [1])["ttft"][0]
            warm = [bench.run([system + q[i]], [1])["ttft"][0] for i in (1, 2, 3)]
            w = sorted(warm)[1]
            print(f"cold {cold * 1000:.0f} ms, warm {w * 1000:.0f} ms (median of 3) -> {w / cold:.2f}x (target <= 0.25)")
        finally:
            client.close()
            proc.terminate()
            proc.wait(timeout=30)
    return 0


def run_hf_static(spec: str | None, dtype: torch.dtype, prompts: list[list[int]], news: list[int],
                  batch: int) -> tuple[int, float]:
    """HF generate over static, left-padded batches; each request's tokens counted up to its limit."""
    from model_loop import _hf_model

    model = _hf_model(spec, dtype)
    pad = 0
    total, t0 = 0, time.perf_counter()
    for s in range(0, len(prompts), batch):
        chunk, limits = prompts[s : s + batch], news[s : s + batch]
        width = max(len(p) for p in chunk)
        ids_ = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        m = max(limits)
        with torch.inference_mode():
            model.generate(ids_, attention_mask=mask, max_new_tokens=m, min_new_tokens=m,
                           do_sample=False, pad_token_id=pad)
        total += sum(limits)
    return total, time.perf_counter() - t0


if __name__ == "__main__":
    sys.exit(main())
