"""Where a runner's decode step goes on CPU (issue 18, item 2): the scheduler in-process
against a real memsvc, the model as `kvserve serve` runs it (dtype and quantization
`auto`), B requests of 128-token prompts decoding together.

Prints, per batch size: the step's wall time split into memsvc round trip, batch build,
forward and sampling (the scheduler's own step_seconds metric), and torch.profiler's top
operators over a few decode steps (self CPU time).

    .venv/bin/python bench/step_profile.py [--batch-sizes 1,32] [--steps 16] [--quantization auto]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_throughput import cpu_flags  # noqa: E402
from model_loop import make_prompts  # noqa: E402
from runner_bench import start_memsvc  # noqa: E402

from kvserve.config.devices import resolve_dtype  # noqa: E402
from kvserve.kernels import get_backend  # noqa: E402
from kvserve.memsvc.client import MemClient  # noqa: E402
from kvserve.messages.frontend_runner import GenerateReq, SamplingParams  # noqa: E402
from kvserve.model.weights import load_model, resolve_quantization  # noqa: E402
from kvserve.runner.metrics import RunnerMetrics  # noqa: E402
from kvserve.runner.scheduler import Scheduler, SchedulerConfig  # noqa: E402

PHASES = ("memsvc", "decode", "sample")  # "decode": batch build + forward


def phase_sums(metrics: RunnerMetrics) -> dict[str, float]:
    reg = metrics.registry
    return {p: reg.get_sample_value("kvserve_runner_step_seconds_sum", {"phase": p}) or 0.0 for p in PHASES}


def int4_projections(model) -> list:
    """The model's int4 projections with torch's packed copies, taken before the scheduler
    hands them the native kernel (which frees those copies)."""
    from kvserve.model.llama import PROJECTIONS
    from kvserve.model.quant import Int4Linear

    lins = [getattr(layer, name) for layer in model.layers for name in PROJECTIONS]
    return [(lin, lin.packed, lin.scales_and_zeros) for lin in lins if isinstance(lin, Int4Linear)]


def compare_native(sched: Scheduler, steps: int, rounds: int, batch: int, int4: list) -> None:
    """Median decode step with the native kernels on (decode attention, RMS norm, rotary, KV
    store, the 4-bit projections, whole layers in one call), with all but the 4-bit
    projections and the one-call layers (torch's int4 kernel), and off, alternating rounds."""
    import statistics

    from kvserve.kernels import native

    supports, rowwise = native.supports, native.rowwise
    kernels = [lin.kernel for lin, _, _ in int4]  # set by the scheduler's use_row_ops
    fused_rows = sched.model.fused_rows
    configs = ("native", "torch int4", "torch ops") if any(kernels) else ("native", "torch ops")
    times: dict[str, list[float]] = {c: [] for c in configs}

    def use(config: str) -> None:
        on = config != "torch ops"
        native.supports = supports if on else (lambda q, k_cache: False)
        native.rowwise = rowwise if on else (lambda x: False)  # RMS norm, rotary, KV store
        sched.model.fused_rows = fused_rows if config == "native" else 0
        for (lin, packed, scales), kernel in zip(int4, kernels, strict=True):
            if packed is not None:
                lin.packed, lin.scales_and_zeros = packed, scales
                lin.kernel = kernel if config == "native" else None

    for r in range(len(configs) * rounds):
        config = configs[r % len(configs)]
        use(config)
        try:
            t0 = time.perf_counter()
            for _ in range(steps):
                sched.step()
            times[config].append((time.perf_counter() - t0) / steps)
        finally:
            use("native")
    med = {c: statistics.median(t) for c, t in times.items()}
    print(f"   native kernels {'available' if native.available() else 'NOT available'}, 4-bit "
          f"{'available' if native.int4_available() else 'NOT available'}: median step "
          + ", ".join(f"{c} {v * 1000:.2f} ms ({batch / v:.1f} tok/s)" for c, v in med.items())
          + f": native {med['torch ops'] / med['native']:.2f}x torch ops", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed (and profiled) per batch")
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--no-pack", action="store_true", help="plain F.linear GEMMs (kvserve.model.dense.pack off, as quant calls it)")
    ap.add_argument("--no-profile", action="store_true", help="timings only")
    ap.add_argument("--profile-prefill", action="store_true",
                    help="also profile the steps that prefill the batch's prompts")
    ap.add_argument("--compare-native", type=int, default=0, metavar="ROUNDS",
                    help="A/B the native kernels (kvserve.kernels.native: decode attention, RMS "
                         "norm, rotary, KV store, 4-bit projections) against the torch ops in the same process: "
                         "ROUNDS alternating rounds of --steps steps each, medians printed (implies --no-profile)")
    ap.add_argument("--batch-invariant", default="on", choices=["on", "off"],
                    help="the runner's [runner] batch_invariant (issue 36)")
    ap.add_argument("--packed-rows", type=int, default=0,
                    help="rows above which quantized projections take their dense copy (default DENSE_ROWS)")
    args = ap.parse_args(argv)
    if args.packed_rows:
        import kvserve.model.quant as quant

        # The class default, and the values that the native kernels' `use_ops` set per weight.
        quant._WeightOnly.dense_rows = args.packed_rows
        quant.NATIVE_INT4_DENSE_ROWS = quant.NATIVE_INT8_DENSE_ROWS = args.packed_rows
    if args.no_pack:
        import kvserve.model.quant as quant

        quant.pack = lambda weight: None
    dtype_name = resolve_dtype(args.dtype, "cpu")
    quant = resolve_quantization(args.quantization, args.model, "cpu")
    loaded = load_model(args.model, dtype=getattr(torch, dtype_name), device="cpu", quantization=quant)
    tok = loaded.tokenizer
    print(f"model {loaded.name} dtype {dtype_name} quantization {quant} threads {torch.get_num_threads()} "
          f"batch_invariant {args.batch_invariant}")
    print(f"cpu flags: {cpu_flags()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="kvserve-prof-") as tmp:
        run_dir = Path(tmp)
        run_dir.chmod(0o700)
        proc, address = start_memsvc(run_dir, args.model, dtype_name, 65536)
        client = MemClient(address, name="prof", timeout_s=30.0)
        mc = loaded.config
        client.attach(n_layers=mc.num_layers, n_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, dtype=dtype_name)
        int4 = int4_projections(loaded.model) if args.compare_native else []
        try:
            for b in [int(x) for x in args.batch_sizes.split(",")]:
                metrics = RunnerMetrics()
                sched = Scheduler(model=loaded.model, mem=client, layout=client.layout,
                                  backend=get_backend("torch"), eos_token_ids=loaded.eos_token_ids,
                                  config=SchedulerConfig(batch_invariant=args.batch_invariant == "on"),
                                  metrics=metrics)
                prompts = make_prompts(tok, b, 128)
                prompts[:, 0] = 2000 + b
                for i, row in enumerate(prompts):
                    sched.add(GenerateReq(f"p{b}-{i}", row.tolist(),
                                          SamplingParams(max_new_tokens=8 + 2 * args.steps * (1 + args.compare_native), ignore_eos=True)))
                prof_ctx = (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                            if args.profile_prefill else contextlib.nullcontext())
                t0, steps, before = time.perf_counter(), 0, phase_sums(metrics)
                with prof_ctx as prof:
                    while any(r.computed < r.prompt_len for r in sched.table) or len(sched.table.running) < b:
                        t1 = time.perf_counter()
                        sched.step()  # prefill, then a few decode steps as warm-up
                        steps += 1
                        if args.profile_prefill:
                            print(f"   step {steps}: {(time.perf_counter() - t1) * 1000:.0f} ms, "
                                  f"{sum(r.computed < r.prompt_len for r in sched.table)} prompts still to compute",
                                  flush=True)
                took = time.perf_counter() - t0
                parts = {p: v - before[p] for p, v in phase_sums(metrics).items()}
                print(f"\n== batch {b}: prefill of {b} x 128 tokens in {steps} steps, {took * 1000:.0f} ms = "
                      f"{b * 128 / took:.0f} prompt tok/s: " + ", ".join(f"{p} {v * 1000:.0f}" for p, v in parts.items())
                      + " ms", flush=True)
                if args.profile_prefill:
                    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top,
                                                    max_name_column_width=48))
                for _ in range(4):
                    sched.step()
                before = phase_sums(metrics)
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    sched.step()
                wall = (time.perf_counter() - t0) / args.steps
                after = phase_sums(metrics)
                parts = {p: (after[p] - before[p]) / args.steps for p in PHASES}
                other = wall - sum(parts.values())
                print(f"\n== batch {b}: decode step {wall * 1000:.2f} ms = {b / wall:.1f} tok/s: "
                      + ", ".join(f"{p} {v * 1000:.2f}" for p, v in parts.items())
                      + f", rest (plan, batch build, emit) {other * 1000:.2f} ms", flush=True)
                if args.compare_native:
                    compare_native(sched, args.steps, args.compare_native, b, int4)
                if args.no_profile or args.compare_native:
                    while sched.has_work():
                        sched.step()
                    continue
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    for _ in range(args.steps):
                        sched.step()
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top,
                                                max_name_column_width=48))
                while sched.has_work():
                    sched.step()
        finally:
            client.close()
            proc.terminate()
            proc.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
