"""End-to-end output tokens/s of `kvserve serve` under `kvserve bench`, for this tree or another.

    .venv/bin/python bench/e2e_throughput.py [--concurrency 32] [--requests 64]
    .venv/bin/python bench/e2e_throughput.py --tree /tmp/kvserve-old   # a checkout of an older commit

Starts `kvserve serve` (the embedded default model, serve's default device and dtype, free
ports, a runtime dir of its own) from `--tree` (its `kvserve` package goes first on
PYTHONPATH; default: this tree), drives it with this tree's `kvserve bench` (random
prompts of --prompt-len tokens, --output-len new tokens forced with ignore_eos, closed loop
at --concurrency streams), prints the output tokens/s beside the CPU's flags, and stops it.
The same client drives either tree, so the figures compare the servers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from kvserve.tools.servectl import start_serve, stop_serve

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8")


def cpu_flags() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            return " ".join(f for f in CPU_FLAGS if f in have) or "none of " + " ".join(CPU_FLAGS)
    return "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", default="", help="repository root whose kvserve serves ('' = this one)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    args = p.parse_args(argv)
    if args.tree:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(args.tree).resolve()),
                                                    os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    with tempfile.TemporaryDirectory(prefix="kvs-e2e-") as tmp:
        svc = start_serve(Path(tmp) / "run", None, dtype=None, device=None)
        try:
            out = Path(tmp) / "bench.json"
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the client: this tree
            subprocess.run(
                [sys.executable, "-m", "kvserve.cli", "bench", "--address", f"127.0.0.1:{svc.port}",
                 "--concurrency", str(args.concurrency), "--num-requests", str(args.requests),
                 "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len),
                 "--ignore-eos", "--quiet", "--json", str(out)],
                check=True, env=env,
            )
            summary = json.loads(out.read_text())["summary"]
        finally:
            rc = stop_serve(svc)
    print(f"tree={args.tree or 'this'} concurrency={args.concurrency} requests={summary['ok']}/"
          f"{summary['requests']} output tok/s={summary['output_tokens_per_s']:.1f} "
          f"ttft p50={summary['ttft_p50_s'] * 1000:.0f} ms  cpu flags: {cpu_flags()}  serve rc={rc}")
    return 0 if summary["ok"] == summary["requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
