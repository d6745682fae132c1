"""Frontend CPU time to detokenize 32 streams x 256 tokens of the default model, old vs new.

    .venv/bin/python bench/detok_bench.py [--streams 32] [--tokens 256] [--repeats 5] [--old-rev REV]

The streams are slices of a fixed mixed text (prose, code, accents, CJK, emoji) encoded by
the embedded default model's tokenizer, each seeded with the 4 prompt tokens before it, and
pushed one token at a time, round-robin, as the frontend does. Three detokenizers run on
the same ids; `time.process_time` over all streams, the best of `--repeats`:

  new                  kvserve.frontend.detok on tokenizers' DecodeStream
  old (transformers)   the previous IncrementalDetokenizer (`git show REV:kvserve/frontend/detok.py`,
                       loaded into a temporary module) on the transformers tokenizer's decode, as
                       the frontend ran it before
  old (tokenizers)     the previous IncrementalDetokenizer on the `tokenizers` decode

It checks that every stream's text is identical across the three and equal to decode() of
the whole stream, and exits 1 if not or if new is not at least 5x faster than old (transformers).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvserve.frontend.detok import IncrementalDetokenizer
from kvserve.model.tokenizer import load_model_tokenizer

OLD_REV = "aee480c79aa77d13213ed35d8f9bcf74da4e3102"
"""The last commit whose kvserve/frontend/detok.py re-decodes a sliding window in Python."""
ROOT = Path(__file__).resolve().parent.parent
CONTEXT = 4  # prompt tokens seeding each stream, as grpc_service's DETOK_CONTEXT
GOAL = 5.0

TEXT = (
    "The quick brown fox jumps over the lazy dog. Café, naïve, façade, jalapeño and crème brûlée "
    "are borrowed words. def fibonacci(n: int) -> int:\n    return n if n < 2 else fibonacci(n - 1) "
    "+ fibonacci(n - 2)\n東京は日本の首都です。你好，世界！안녕하세요. Emoji: 😀🚀🎉👍🏽 and symbols € £ ¥ "
    "→ ∞ ≠ ≤. In 1969, Apollo 11 landed on the Moon; \"one small step\" was heard by millions. "
    "Σπίτι, дом, בית, بيت: the word 'house' in four scripts.\n"
)


def load_old(rev: str) -> types.ModuleType:
    source = subprocess.run(["git", "show", f"{rev}:kvserve/frontend/detok.py"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout
    mod = types.ModuleType("old_detok")
    sys.modules[mod.__name__] = mod  # dataclass annotations resolve through sys.modules
    exec(compile(source, "<old_detok>", "exec"), mod.__dict__)
    return mod


def make_streams(encode: Callable[[str], list[int]], streams: int, tokens: int) -> list[tuple[list[int], list[int]]]:
    """(context ids, output ids) per stream, at different offsets of the text."""
    ids = encode(TEXT * (1 + streams * tokens // len(encode(TEXT))))
    out = []
    for s in range(streams):
        start = CONTEXT + (s * 37) % (len(ids) - tokens - CONTEXT)
        out.append((ids[start - CONTEXT : start], ids[start : start + tokens]))
    return out


def run(make: Callable[[list[int]], Any], streams: list[tuple[list[int], list[int]]]) -> tuple[float, list[str]]:
    """CPU seconds to push every stream's ids one at a time, round-robin, then finish."""
    t0 = time.process_time()
    detoks = [make(ctx) for ctx, _ in streams]
    texts = [[] for _ in streams]
    for t in range(len(streams[0][1])):
        for i, (_, ids) in enumerate(streams):
            texts[i].append(detoks[i].push([ids[t]]))
    for i, d in enumerate(detoks):
        texts[i].append(d.flush())
    return time.process_time() - t0, ["".join(t) for t in texts]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--old-rev", default=OLD_REV, help="git revision holding the old detok.py")
    args = p.parse_args(argv)

    from kvserve.model.weights import load_tokenizer  # transformers, for the old frontend's decode

    tok = load_model_tokenizer(None)
    hf = load_tokenizer(None).tokenizer
    old = load_old(args.old_rev)
    streams = make_streams(tok.encode, args.streams, args.tokens)

    def hf_decode(ids: list[int]) -> str:
        return hf.decode(ids, skip_special_tokens=True)

    cases: dict[str, Callable[[list[int]], Any]] = {
        "new": lambda ctx: IncrementalDetokenizer(tok, ctx),
        "old (transformers)": lambda ctx: old.IncrementalDetokenizer(hf_decode, ctx),
        "old (tokenizers)": lambda ctx: old.IncrementalDetokenizer(tok.decode, ctx),
    }
    want = [tok.decode(ctx + ids)[len(tok.decode(ctx)) :] for ctx, ids in streams]
    best: dict[str, float] = {}
    ok = True
    for name, make in cases.items():
        times = []
        for _ in range(args.repeats):
            seconds, texts = run(make, streams)
            times.append(seconds)
            bad = [i for i, (a, b) in enumerate(zip(texts, want, strict=True)) if a != b]
            if bad:
                ok = False
                print(f"{name}: stream {bad[0]} text differs: {texts[bad[0]]!r} != {want[bad[0]]!r}")
        best[name] = min(times)
    n = args.streams * args.tokens
    print(f"{args.streams} streams x {args.tokens} tokens of {tok.name}, one token per push; "
          f"CPU time (time.process_time), best of {args.repeats}")
    for name, seconds in best.items():
        print(f"  {name:20s} {seconds * 1e3:8.1f} ms  {seconds / n * 1e6:6.2f} us/token")
    ratio = best["old (transformers)"] / best["new"]
    print(f"  old (transformers) / new = {ratio:.1f}x (goal >= {GOAL:.0f}x); "
          f"old (tokenizers) / new = {best['old (tokenizers)'] / best['new']:.1f}x")
    print(f"  texts identical across all three and equal to decode(): {ok}")
    return 0 if ok and ratio >= GOAL else 1


if __name__ == "__main__":
    sys.exit(main())
