"""Decode speed of the newer families on CPU (issue 38, item 6): random bf16 weights in the shape
of Qwen3-0.6B and of Qwen3-30B-A3B cut to 4 of its 48 layers (its 128 experts, top 8), written
once under --work; each run by `bench/step_profile.py` (the runner's scheduler in-process
against a real memsvc, batch-invariant as served) at 1 and 32 streams, float and int4, and by
HF transformers (`generate`, bf16, greedy) at the same batch sizes: decode tok/s, the time of
--new tokens less that of one, over the rest.

    .venv/bin/python bench/families_speed.py [--models qwen3-0.6b,qwen3-moe-4l] [--batch-sizes 1,32]

No GGUF of these shapes is made here, so llama.cpp is not run beside them (bench/peers.py runs it
on the default model).
"""

from __future__ import annotations

import argparse
import io
import re
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_profile  # noqa: E402
from e2e_throughput import cpu_flags  # noqa: E402

from kvserve.tools.tinymodel import QWEN3_0_6B, QWEN3_30B_A3B_4_LAYERS, write_random_llama  # noqa: E402

SHAPES = {"qwen3-0.6b": QWEN3_0_6B, "qwen3-moe-4l": QWEN3_30B_A3B_4_LAYERS}
DECODE = re.compile(r"== batch (\d+): decode step ([\d.]+) ms = ([\d.]+) tok/s")


def kvserve_decode(model: Path, quantization: str, batches: list[int], steps: int) -> dict[int, float]:
    out = io.StringIO()
    with redirect_stdout(out):
        step_profile.main(["--model", str(model), "--dtype", "bfloat16", "--quantization", quantization,
                           "--batch-sizes", ",".join(map(str, batches)), "--steps", str(steps), "--no-profile"])
    return {int(b): float(tps) for b, _, tps in DECODE.findall(out.getvalue())}


def hf_decode(model: Path, batches: list[int], new: int) -> dict[int, float]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.bfloat16).eval()
    got = {}
    for b in batches:
        ids = torch.randint(10, 1000, (b, 128), generator=torch.Generator().manual_seed(b))

        def run(n: int, ids: torch.Tensor = ids) -> float:
            t0 = time.perf_counter()
            with torch.no_grad():
                hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            return time.perf_counter() - t0

        run(2)  # warm-up
        got[b] = b * (new - 1) / (run(new) - run(1))
    return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(SHAPES))
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--steps", type=int, default=8, help="decode steps kvserve times")
    ap.add_argument("--new", type=int, default=9, help="tokens HF generates (its decode rate: new - 1 over the rest)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/kvserve-families"))
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    print(f"cpu flags: {cpu_flags()}; threads {torch.get_num_threads()}")
    print("| model | system | " + " | ".join(f"{b} streams" for b in batches) + " |")
    print("|---|---|" + "---|" * len(batches))
    for name in args.models.split(","):
        path = args.work / name
        if not (path / "config.json").exists():
            write_random_llama(path, SHAPES[name])
        rows = {f"kvserve bf16 {q}": kvserve_decode(path, q, batches, args.steps) for q in ("none", "int4")}
        rows["HF transformers bf16"] = hf_decode(path, batches, args.new)
        for system, tps in rows.items():
            print(f"| {name} | {system} | " + " | ".join(f"{tps.get(b, float('nan')):.1f}" for b in batches) + " |",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
