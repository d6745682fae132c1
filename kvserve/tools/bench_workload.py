"""What `kvserve bench` sends, and the face of a server it sends to.

`make_workloads` builds the requests (`Workload`: token ids or text, and an output budget)
from --prompts-file or from seeded random lengths, with optional shared system prompts;
`_sampling_seed` is the per-request seed both APIs send. `Server` is what a driver
(`bench_grpc.py`, `bench_openai.py`) yields once connected, `ServerError` what it raises
when it cannot connect.

This module knows nothing of gRPC, HTTP or the server's internals: only the command-line
arguments that describe the load.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from kvserve.tools.bench_report import Record


@dataclass(frozen=True, slots=True)
class Workload:
    """One request to send: either token ids or text, and its output budget."""

    token_ids: list[int] | None
    text: str | None
    max_new_tokens: int


@dataclass(frozen=True, slots=True)
class Server:
    """A connected server: the vocabulary to draw prompt ids from, and how to send it one
    request (`send(workload, index, record, t0)` streams the answer into the record)."""

    vocab_size: int
    send: Callable[[Workload, int, Record, float], Awaitable[None]]


class ServerError(Exception):
    """The server could not be reached or described before the run (nothing was sent)."""


def _parse_range(text: str, name: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)(?::(\d+))?", text.strip())
    if not m:
        raise ValueError(f"--{name}: expected N or LO:HI, got {text!r}")
    lo = int(m.group(1))
    hi = int(m.group(2) or lo)
    if lo <= 0 or hi < lo:
        raise ValueError(f"--{name}: need 0 < LO <= HI, got {text!r}")
    return lo, hi


def make_workloads(args: argparse.Namespace, vocab_size: int, n: int) -> list[Workload]:
    """Build `n` requests: from --prompts-file, or random token ids of the given lengths.

    The draws are seeded by (--seed, --concurrency, --rate), so runs at different load
    levels send different prompts and a later run does not hit the prefix cache that an
    earlier one filled. The --shared-prefix system prompts are seeded by --seed alone:
    sharing them across levels is what that flag asks for.
    """
    rng = random.Random(f"{args.seed}/{args.concurrency}/{args.rate}")
    out_lo, out_hi = _parse_range(args.output_len, "output-len")
    if args.prompts_file:
        rows = []
        for lineno, line in enumerate(Path(args.prompts_file).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{args.prompts_file}:{lineno}: not JSON ({exc})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError(f"{args.prompts_file}:{lineno}: expected {{\"prompt\": str, ...}}")
            rows.append(row)
        if not rows:
            raise ValueError(f"{args.prompts_file}: no prompts")
        return [
            Workload(None, rows[i % len(rows)]["prompt"],
                     int(rows[i % len(rows)].get("max_new_tokens") or rng.randint(out_lo, out_hi)))
            for i in range(n)
        ]
    lo, hi = _parse_range(args.prompt_len, "prompt-len")
    # Random ids from the bulk of the vocabulary: special tokens sit at the low end.
    low_id = min(1000, vocab_size // 4)

    def ids(r: random.Random, k: int) -> list[int]:
        return [r.randrange(low_id, vocab_size) for _ in range(k)]

    prefix_rng = random.Random(args.seed)
    prefixes = [ids(prefix_rng, args.prefix_len) for _ in range(args.shared_prefix)]
    work = []
    for i in range(n):
        body = ids(rng, rng.randint(lo, hi))
        if prefixes:
            body = prefixes[i % len(prefixes)] + body
        work.append(Workload(body, None, rng.randint(out_lo, out_hi)))
    return work


def _sampling_seed(args: argparse.Namespace, index: int) -> int:
    """The per-request sampling seed when --temperature > 0 (the same in both APIs)."""
    return args.seed * 100003 + index
