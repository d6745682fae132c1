"""Idle memory of a fresh `kvserve serve`: VmRSS of the supervisor and of each child.

    .venv/bin/python bench/idle_memory.py [--model PATH] [--settle-s 5] [--runners 1]

Starts `kvserve serve` (the embedded default model unless --model, free ports, a runtime
dir of its own), waits until it serves, lets it settle, reads VmRSS of serve and of every
child from /proc (the role from the child's command line), prints a table in MiB with the
targets (frontend <= 150, serve supervisor <= 80), stops serve (checking that nothing is
left behind) and exits 1 when a target is missed. The "libtorch" column says whether the
process maps torch's library, the usual reason for a light process to be heavy.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve.tools.servectl import ROLES, children_of, rss_kib, start_serve, stop_serve  # noqa: E402

TARGETS_MIB = {"serve": 80.0, "frontend": 150.0}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="model for serve ('' = the embedded default)")
    p.add_argument("--runners", type=int, default=1, help="runner workers")
    p.add_argument("--settle-s", type=float, default=5.0, help="seconds to wait once serving")
    p.add_argument("--ready-timeout-s", type=float, default=600.0, help="seconds serve may take to be ready")
    return p


def maps_libtorch(pid: int) -> bool:
    """True when `pid` has torch's shared library mapped."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def processes(serve_pid: int) -> list[tuple[str, int]]:
    """(role, pid) of serve and of each child, children in ROLES order."""
    found = [("serve", serve_pid)]
    kids = children_of(serve_pid)
    for role in ROLES:
        found += [(role, pid) for pid, cmd in sorted(kids.items()) if f"kvserve.cli {role} " in cmd]
    return found


def report(rows: list[tuple[str, int]]) -> bool:
    """Print the table; True when every target is met."""
    ok = True
    print(f"{'process':<10} {'pid':>8} {'RSS MiB':>9} {'target':>8} {'libtorch':>9}  verdict")
    for role, pid in rows:
        mib = rss_kib(pid) / 1024
        target = TARGETS_MIB.get(role)
        met = target is None or mib <= target
        ok &= met
        verdict = "-" if target is None else ("ok" if met else "OVER")
        shown = "-" if target is None else f"{target:.0f}"
        print(f"{role:<10} {pid:>8} {mib:>9.1f} {shown:>8} {'yes' if maps_libtorch(pid) else 'no':>9}  {verdict}")
    return ok


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvserve-idle-") as tmp:
        t0 = time.monotonic()
        svc = start_serve(Path(tmp) / "rt", Path(args.model) if args.model else None,
                          "--runners", str(args.runners), ready_s=args.ready_timeout_s,
                          dtype=None, device=None)
        try:
            print(f"serving after {time.monotonic() - t0:.1f} s; settling {args.settle_s:.0f} s", flush=True)
            time.sleep(args.settle_s)
            rows = processes(svc.proc.pid)
            roles = [role for role, _ in rows]
            if roles.count("frontend") != 1 or roles.count("memsvc") != 1 or roles.count("runner") != args.runners:
                print(f"unexpected children: {rows}", file=sys.stderr)
                return 1
            ok = report(rows)
        finally:
            status = stop_serve(svc)
        print(f"serve stopped with status {status}")
        if status != 0:
            return 1
    if not ok:
        print("a memory target is missed", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
