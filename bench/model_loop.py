"""Baselines for the serving benchmark: the bare static torch loop and HF `generate`.

Both run greedy decoding of the same static batch of equal-length prompts (~128 tokens
each, different per request) for a fixed number of new tokens, in one dtype, and print
aggregate tokens/s (all generated tokens over wall time, prefill included). The bare loop
runs kvserve's own model code with a contiguous cache (kvserve.tools.staticloop).

    .venv/bin/python bench/model_loop.py --dtype bfloat16 --batch-sizes 1,8,32
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from kvserve.model.files import resolve_model
from kvserve.model.weights import load_model
from kvserve.tools.staticloop import static_generate

TEXT = (
    "The history of computing is a story of people, machines and ideas. Early mechanical "
    "calculators gave way to electronic computers built from vacuum tubes, then transistors, "
    "then integrated circuits holding billions of switches. Along the way programmers invented "
    "languages, operating systems, networks and databases, and each generation of hardware "
    "made new kinds of software possible. Today small language models run on laptops, and "
    "serving them efficiently means batching many requests, caching their keys and values, "
    "and scheduling work so that no processor cycle is wasted. "
)


def make_prompts(tokenizer, batch: int, length: int) -> torch.Tensor:
    """`batch` different prompts of exactly `length` tokens each."""
    rows = []
    for i in range(batch):
        ids = tokenizer(f"Request {i}. " + TEXT * (1 + length // 60)).input_ids
        if len(ids) < length:
            raise ValueError(f"prompt text too short for {length} tokens")
        rows.append(ids[i % 7 : i % 7 + length])
    return torch.tensor(rows, dtype=torch.int64)


def run_hf(spec: str | None, dtype: torch.dtype, prompts: torch.Tensor, new: int) -> float:
    """Aggregate tokens/s of transformers `generate` (greedy, no early stop)."""
    model = _hf_model(spec, dtype)
    mask = torch.ones_like(prompts)
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(
            prompts, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False
        )
        dt = time.perf_counter() - t0
    return (out.shape[1] - prompts.shape[1]) * prompts.shape[0] / dt


_HF_CACHE: dict[tuple[str | None, torch.dtype], torch.nn.Module] = {}


def _hf_model(spec: str | None, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    key = (spec, dtype)
    if key not in _HF_CACHE:
        path = resolve_model(spec)
        if path.is_dir():
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, dtype=dtype
            )
        _HF_CACHE[key] = model.eval()
    return _HF_CACHE[key]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="HF dir or .gguf (default: the embedded model)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--no-hf", action="store_true", help="skip transformers generate")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    loaded = load_model(args.model, dtype=dtype, device="cpu")
    print(f"model {loaded.name} dtype {args.dtype} threads {torch.get_num_threads()}", flush=True)
    # Warm-up: first calls pay for oneDNN/MKL kernel selection.
    static_generate(loaded.model, make_prompts(loaded.tokenizer, 1, 16), 4)
    print("system      batch  tok/s   (decode tok/s, prefill s)", flush=True)
    for b in sizes:
        prompts = make_prompts(loaded.tokenizer, b, args.prompt_len)
        run = static_generate(loaded.model, prompts, args.new_tokens)
        print(
            f"bare-loop   {b:5d}  {run.tokens_per_s:7.1f} ({run.decode_tokens_per_s:.1f}, "
            f"{run.prefill_s:.2f})",
            flush=True,
        )
        if not args.no_hf:
            print(
                f"hf-generate {b:5d}  {run_hf(args.model, dtype, prompts, args.new_tokens):7.1f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
