"""Does a greedy request's output depend on what runs beside it? The load check of issue 36.

    .venv/bin/python bench/batch_invariance.py [--serve-args "--dtype float32 --quantization none"]

Starts `kvserve serve` (the embedded default model; serve's default device, dtype and
quantization unless --serve-args say otherwise) and sends --prompts greedy chat prompts over
gRPC three ways: one at a time on a cold cache (the reference), one at a time again (their
prefixes now come from the radix cache), and all at once while --load other requests
(random token ids of random lengths, greedy and sampled, random output lengths) run beside
them. Prints, per prompt, whether each later pass gave the reference's tokens and where it
first differed, then how many of the prompts differ in each pass, beside the CPU's flags.
Nothing is timed: the figure is the count of prompts whose tokens moved.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import tempfile
import threading
from pathlib import Path

from e2e_throughput import cpu_flags

from kvserve.tools.servectl import start_serve, stop_serve
from kvserve.v1 import generator_pb2 as pb

PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
    "Explain what a hash table is to a child.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Name the planets of the solar system in order.",
    "Translate 'good morning' into French, Spanish and German.",
)


def _chat(text: str, max_new: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=text)]),
                              sampling=pb.SamplingParams(max_new_tokens=max_new))


def _tokens(stub, req: pb.GenerateRequest) -> list[int]:
    return [t for m in stub.Generate(req, timeout=600) for t in m.token_ids]


def _first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _load(stub, n: int, vocab: int, seed: int) -> list[threading.Thread]:
    """`n` other requests in threads of their own: random ids, greedy or sampled."""
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(16, 400))]
        temperature = 0.0 if i % 2 == 0 else 1.0
        reqs.append(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
            max_new_tokens=rng.randint(16, 96), temperature=temperature, ignore_eos=True)))
    threads = [threading.Thread(target=_tokens, args=(stub, r), daemon=True) for r in reqs]
    for t in threads:
        t.start()
    return threads


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=4, help=f"how many of the {len(PROMPTS)} prompts")
    p.add_argument("--load", type=int, default=24, help="other requests beside them in the loaded pass")
    p.add_argument("--max-new", type=int, default=48, help="new tokens per prompt (greedy)")
    p.add_argument("--serve-args", default="", help="extra flags for kvserve serve")
    p.add_argument("--seed", type=int, default=1, help="seed of the load's prompts")
    p.add_argument("--json", help="write the tokens and the divergences here")
    args = p.parse_args(argv)
    prompts = PROMPTS[: args.prompts]
    with tempfile.TemporaryDirectory(prefix="kvs-inv-") as tmp:
        svc = start_serve(Path(tmp) / "run", None, *shlex.split(args.serve_args), dtype=None, device=None)
        try:
            vocab = svc.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).vocab_size
            cold = [_tokens(svc.stub, _chat(t, args.max_new)) for t in prompts]
            warm = [_tokens(svc.stub, _chat(t, args.max_new)) for t in prompts]
            load = _load(svc.stub, args.load, vocab, args.seed)
            loaded: list[list[int]] = [[] for _ in prompts]

            def one(i: int) -> None:
                loaded[i] = _tokens(svc.stub, _chat(prompts[i], args.max_new))

            mine = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
            for t in mine:
                t.start()
            for t in mine + load:
                t.join()
        finally:
            rc = stop_serve(svc)
    passes = {"again, prefix cached": warm, f"beside {args.load} others": loaded}
    report = {"serve_args": args.serve_args, "cpu_flags": cpu_flags(), "reference": cold, "passes": {}}
    for name, got in passes.items():
        diffs = [_first_diff(ref, g) for ref, g in zip(cold, got, strict=True)]
        report["passes"][name] = {"tokens": got, "first_divergence": diffs}
        for i, d in enumerate(diffs):
            print(f"{name:>24} prompt {i}: " + ("same tokens" if d is None else f"differs from token {d}"))
    print(f"serve args: {args.serve_args or '(defaults)'}  cpu flags: {cpu_flags()}")
    for name, r in report["passes"].items():
        moved = sum(d is not None for d in r["first_divergence"])
        print(f"{name}: {moved} of {len(prompts)} prompts differ from the cold run alone "
              f"(first divergences {[d for d in r['first_divergence'] if d is not None]})")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
