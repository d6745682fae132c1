"""Wire codec micro-benchmark: encode + decode of memsvc's 64-item `Step`, new vs old codec.

    .venv/bin/python bench/codec_bench.py [--rounds 400] [--no-old] [--old-rev REV]

Times `REQUESTS.encode(step)` followed by `REQUESTS.decode(frame)` (µs per round, the
median of `--rounds` batches) for two messages: 64 `Grow` items (the frame
bench/memsvc_bench.py sends) and 64 `Grow` + 8 `Admit` of 100 tokens. Unless `--no-old`,
the same rounds run through the hand-written dataclass codec this project used before
msgspec, loaded from git (`git show REV:kvserve/wire.py` and its message module) into
temporary modules, so one command prints the before and after figures.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvserve.messages import runner_memsvc as new

OLD_REV = "aee480c79aa77d13213ed35d8f9bcf74da4e3102"
"""The last commit whose kvserve/wire.py is the hand-written codec."""

ROOT = Path(__file__).resolve().parent.parent


def _module(name: str, source: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    sys.modules[name] = mod  # dataclass annotations resolve through sys.modules
    exec(compile(source, f"<{name}>", "exec"), mod.__dict__)
    return mod


def load_old(rev: str = OLD_REV) -> types.ModuleType:
    """The runner⇄memsvc message module of `rev` on top of the wire.py of `rev`."""

    def show(path: str) -> str:
        return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout

    _module("_old_kvserve_wire", show("kvserve/wire.py"))
    source = show("kvserve/messages/runner_memsvc.py")
    return _module("_old_runner_memsvc",
                   source.replace("from kvserve.wire import", "from _old_kvserve_wire import"))


def steps(m: Any) -> dict[str, Any]:
    """The benchmark's messages, built from message module `m` (old or new)."""
    grows = [m.Grow(i, 200) for i in range(64)]
    admits = [m.Admit(100 + i, list(range(i, i + 100)), 128) for i in range(8)]
    return {"64 grow": m.Step(lease=1 << 61, grow=grows),
            "64 grow + 8 admit": m.Step(lease=1 << 61, admit=admits, grow=grows)}


def per_round_us(encode: Callable[[Any], bytes], decode: Callable[[bytes], Any], msg: Any,
                 rounds: int, inner: int = 20) -> float:
    """Median µs of one encode + decode, over `rounds` batches of `inner` rounds."""
    assert decode(encode(msg)) == msg
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(inner):
            decode(encode(msg))
        samples.append((time.perf_counter() - t0) / inner * 1e6)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--no-old", action="store_true", help="skip the old codec")
    parser.add_argument("--old-rev", default=OLD_REV, help="git revision of the old codec")
    args = parser.parse_args()
    old = None if args.no_old else load_old(args.old_rev)
    new_msgs = steps(new)
    old_msgs = steps(old) if old is not None else {}
    for name, msg in new_msgs.items():
        frame = new.REQUESTS.encode(msg)
        t_new = per_round_us(new.REQUESTS.encode, new.REQUESTS.decode, msg, args.rounds)
        line = f"{name:18s} ({len(frame)} B): msgspec {t_new:6.2f} us"
        if old is not None:
            t_old = per_round_us(old.CODEC.encode, old.CODEC.decode, old_msgs[name], args.rounds)
            line += f"   old codec {t_old:6.2f} us   speedup {t_old / t_new:.1f}x"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
