"""Chaos soak of `kvserve serve`: streaming clients while a child of serve dies by kill -9
every `--kill-every-s` seconds, then a report of what the clients and memsvc saw.

    .venv/bin/python bench/chaos_soak.py --duration-s 600
    .venv/bin/python bench/chaos_soak.py --duration-s 120 --model /path/to/tiny --json out.json

It starts its own `kvserve serve --runners 2` (tmp runtime dir, free ports, serve's logs and
its children's in `--log`). Before any fault it computes the greedy output of every prompt of
a fixed pool, one sequential Generate each. Then `--clients` threads stream requests over gRPC,
half greedy (ignore_eos, fixed max_new_tokens), half sampled with a seed, each with a
`--deadline-s` deadline; a failed request is followed by a short sleep and a new request. A
seeded RNG picks the victims from a shuffled cycle of frontend, memsvc and runner (a random
one of the runners), so three kills hit each role once. At the end: wait until the service
is SERVING, let memsvc settle, read its stats, stop serve and check nothing is left behind.

The report (printed, and as JSON with `--json`): requests sent, succeeded (ended OK with a
final "length" or "stop"), failed by status, hung (DEADLINE_EXCEEDED, or no return within the
deadline + 10 s), greedy outputs that differ from the reference, memsvc's request-held slots
after the settle, invariant violations (summed over memsvc's restarts), leftovers,
availability (succeeded / sent) and, per kill, the seconds until a request started after it
succeeded. Exit status 1 when a must-be-0 figure is not 0, availability is under 0.90 or a
recovery goal is missed (`--no-fail`: 0 whenever the soak ran). Knows the gRPC API,
kvserve.tools.servectl and memsvc's Stats, nothing of the children's internals.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402
import msgspec  # noqa: E402

from kvserve.messages.runner_memsvc import StatsReply  # noqa: E402
from kvserve.tools.servectl import LeftBehind, Service, start_serve, stop_serve  # noqa: E402
from kvserve.v1 import generator_pb2 as pb  # noqa: E402
from kvserve.v1 import generator_pb2_grpc as pb_grpc  # noqa: E402

ROLES = ("frontend", "memsvc", "runner")
RECOVERY_GOALS_S = {"frontend": 10.0, "memsvc": 20.0}
AVAILABILITY_GOAL = 0.90
FINISHED = ("length", "stop")
HANG_GRACE_S = 10.0
RETRY_SLEEP_S = 0.5
# reconnect quickly to a restarted frontend: the default back-off grows to minutes
CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                   ("grpc.max_reconnect_backoff_ms", 1000)]
PREFIX = "You are a terse assistant; answer in one line. "
TOPICS = ("tides", "prime numbers", "bread", "glaciers", "violins", "comets", "moss", "ink")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=float, default=600.0, help="how long the clients run")
    p.add_argument("--kill-every-s", type=float, default=30.0, help="seconds between two kill -9")
    p.add_argument("--clients", type=int, default=8, help="client threads (half greedy, half sampled)")
    p.add_argument("--prompts", type=int, default=16, help="size of the prompt pool")
    p.add_argument("--max-new", type=int, default=24, help="max_new_tokens of the greedy requests")
    p.add_argument("--deadline-s", type=float, default=60.0, help="gRPC deadline of every request")
    p.add_argument("--seed", type=int, default=0, help="seeds the victims, prompts and sampling")
    p.add_argument("--model", default="", help="model of serve ('' = the embedded default)")
    p.add_argument("--runners", type=int, default=2)
    p.add_argument("--kv-tokens", type=int, default=4096, help="serve's KV pool size")
    p.add_argument("--policy", default="", help="reserve | optimistic ('' = serve's default)")
    p.add_argument("--device", default="cpu", help="serve's --device ('' = serve's default)")
    p.add_argument("--dtype", default="float32", help="serve's --dtype ('' = serve's default)")
    p.add_argument("--quantization", default="", help="serve's --quantization ('' = serve's default, auto)")
    p.add_argument("--ready-s", type=float, default=900.0, help="how long serve may take to start")
    p.add_argument("--settle-s", type=float, default=120.0, help="end: wait for SERVING and for memsvc")
    p.add_argument("--log", default="", help="file for serve's and its children's logs ('' = a tmp file)")
    p.add_argument("--json", default="", help="also write the report to this file")
    p.add_argument("--no-fail", action="store_true", help="exit 0 whatever the figures")
    return p


@dataclass(slots=True)
class Outcome:
    """One request as a client saw it; times in seconds since the clients started."""

    client: int
    greedy: bool
    started: float
    ended: float
    code: str  # "OK", a gRPC status name, or "OK/<finish_reason or none>" for a bad end
    details: str = ""
    differs: bool = False

    @property
    def ok(self) -> bool:
        return self.code == "OK"


@dataclass(slots=True)
class Kill:
    role: str
    pid: int
    t_s: float
    recovery_s: float | None = None
    goal_s: float | None = None
    met: bool = True
    failed_in_flight: int = 0  # requests running at the kill that failed
    failed_after: int = 0  # requests started after the kill (before the next one) that failed


def cpu_flags() -> list[str]:
    """The CPU's avx, avx2, avx512* and amx* flags (lscpu, else /proc/cpuinfo)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        text = ""
    lines = [ln for ln in text.splitlines() if ln.startswith("Flags:")]
    if not lines:
        lines = [ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")][:1]
    flags = lines[0].split(":", 1)[1].split() if lines else []
    return sorted(f for f in flags if f in ("avx", "avx2") or f.startswith(("avx512", "amx")))


def prompt_pool(n: int) -> list[str]:
    """`n` distinct prompts; the even ones share a prefix (the prefix cache is exercised)."""
    return [f"{PREFIX if i % 2 == 0 else ''}Question {i}: say something about {TOPICS[i % len(TOPICS)]}."
            for i in range(n)]


def greedy_request(prompt: str, max_new: int, request_id: str) -> pb.GenerateRequest:
    s = pb.SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)
    return pb.GenerateRequest(text=prompt, sampling=s, request_id=request_id)


def sampled_request(rng: random.Random, prompt: str, max_new: int, request_id: str) -> pb.GenerateRequest:
    s = pb.SamplingParams(temperature=rng.choice([0.7, 1.0]), top_p=0.9, seed=rng.randrange(2**63),
                          max_new_tokens=rng.randint(1, max_new))
    return pb.GenerateRequest(text=prompt, sampling=s, request_id=request_id)


def consume(call: Any) -> tuple[list[int], str]:
    """Read a Generate stream: (every token id, the finish_reason of its final message)."""
    tokens: list[int] = []
    reason = ""
    for msg in call:
        tokens.extend(msg.token_ids)
        reason = reason or msg.finish_reason
    return tokens, reason


def references(stub: pb_grpc.GeneratorStub, prompts: list[str], max_new: int,
               deadline_s: float) -> dict[str, list[int]]:
    """The fault-free greedy output of every prompt, one request at a time."""
    refs = {}
    for i, prompt in enumerate(prompts):
        tokens, reason = consume(stub.Generate(greedy_request(prompt, max_new, f"ref-{i}"), timeout=deadline_s))
        if reason not in FINISHED or len(tokens) != max_new:
            raise RuntimeError(f"reference {i} ended {reason!r} after {len(tokens)} tokens")
        refs[prompt] = tokens
    return refs


class Clients:
    """The client threads: even ones greedy, odd ones sampled; every outcome recorded."""

    def __init__(self, stub: pb_grpc.GeneratorStub, refs: dict[str, list[int]], args: argparse.Namespace) -> None:
        self.stub, self.refs, self.args = stub, refs, args
        self.prompts = list(refs)
        self.outcomes: list[Outcome] = []
        self.inflight: dict[int, tuple[float, str]] = {}  # client -> (start, request id)
        self.hung_ids: set[str] = set()
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(args.clients)]
        self.t0 = 0.0

    def now(self) -> float:
        return time.monotonic() - self.t0

    def start(self) -> None:
        self.t0 = time.monotonic()
        for t in self.threads:
            t.start()

    def _run(self, k: int) -> None:
        rng = random.Random(self.args.seed * 1000 + k)
        i = 0
        while not self.stopping.is_set():
            i += 1
            outcome = self._one(k, rng, f"chaos-{self.args.seed}-{k}-{i}")
            with self.lock:
                self.outcomes.append(outcome)
                self.inflight.pop(k, None)
            if not outcome.ok:
                time.sleep(RETRY_SLEEP_S)

    def _one(self, k: int, rng: random.Random, request_id: str) -> Outcome:
        prompt, greedy = rng.choice(self.prompts), k % 2 == 0
        req = (greedy_request(prompt, self.args.max_new, request_id) if greedy
               else sampled_request(rng, prompt, self.args.max_new, request_id))
        started = self.now()
        with self.lock:
            self.inflight[k] = (started, request_id)
        try:
            tokens, reason = consume(self.stub.Generate(req, timeout=self.args.deadline_s))
        except grpc.RpcError as exc:
            return Outcome(k, greedy, started, self.now(), exc.code().name, exc.details() or "")
        code = "OK" if reason in FINISHED else f"OK/{reason or 'none'}"
        differs = code == "OK" and greedy and tokens != self.refs[prompt]
        details = f"{prompt!r}: got {tokens}, reference {self.refs[prompt]}" if differs else ""
        return Outcome(k, greedy, started, self.now(), code, details, differs)

    def watch_hung(self) -> None:
        """Count a request in flight longer than the deadline + HANG_GRACE_S as hung."""
        limit = self.args.deadline_s + HANG_GRACE_S
        with self.lock:
            self.hung_ids |= {rid for start, rid in self.inflight.values() if self.now() - start > limit}

    def finish(self) -> None:
        """Stop sending; wait for the threads (a thread still out after the limit is hung)."""
        self.stopping.set()
        end = time.monotonic() + self.args.deadline_s + HANG_GRACE_S + 1.0
        while any(t.is_alive() for t in self.threads) and time.monotonic() < end:
            self.watch_hung()
            time.sleep(0.2)
        self.watch_hung()


class StatsWatch:
    """Samples memsvc's stats in a thread; sums invariant violations over memsvc's restarts
    (a restarted memsvc counts from 0 again)."""

    def __init__(self, svc: Service, every_s: float = 1.0) -> None:
        self.svc, self.every_s = svc, every_s
        self.banked = self.current = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    @property
    def violations(self) -> int:
        return self.banked + self.current

    def observe(self, st: StatsReply) -> None:
        if st.invariant_violations < self.current:
            self.banked += self.current
        self.current = st.invariant_violations

    def _run(self) -> None:
        while not self.stopping.wait(self.every_s):
            try:
                self.observe(self.svc.stats())
            except Exception:  # memsvc is down or restarting
                pass

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()


def kill_one(svc: Service, role: str, rng: random.Random, t_s: float) -> Kill:
    """kill -9 a live process of `role` (a random runner), waiting up to 15 s for one."""
    end = time.monotonic() + 15.0
    while not (pids := svc.role_pids()[role]) and time.monotonic() < end:
        time.sleep(0.2)
    if not pids:
        return Kill(role, 0, t_s, met=False)
    pid = rng.choice(pids)
    os.kill(pid, signal.SIGKILL)
    print(f"  {t_s:7.1f} s  kill -9 {role} (pid {pid})", flush=True)
    return Kill(role, pid, t_s)


def chaos(svc: Service, clients: Clients, args: argparse.Namespace) -> list[Kill]:
    """Until the duration is over: a kill every `kill_every_s`, from a reshuffled role cycle."""
    rng = random.Random(args.seed)
    order: list[str] = []
    kills: list[Kill] = []
    while (now := clients.now()) < args.duration_s:
        clients.watch_hung()
        if now >= (len(kills) + 1) * args.kill_every_s:
            order = order or rng.sample(ROLES, len(ROLES))
            kills.append(kill_one(svc, order.pop(), rng, clients.now()))
        time.sleep(0.1)
    return kills


def score_kills(kills: list[Kill], outcomes: list[Outcome]) -> None:
    """Recovery: from the kill to the end of the first success among requests started after it.
    What each kill cost: the failures of requests in flight at it, and of requests started
    after it and before the next kill (the profile of what bounds availability)."""
    for kill, nxt in zip(kills, [*(k.t_s for k in kills[1:]), float("inf")], strict=True):
        ends = [o.ended for o in outcomes if o.ok and o.started > kill.t_s]
        kill.recovery_s = round(min(ends) - kill.t_s, 2) if ends else None
        failed = [o for o in outcomes if not o.ok and kill.t_s <= o.ended < nxt]
        kill.failed_in_flight = sum(o.started < kill.t_s for o in failed)
        kill.failed_after = len(failed) - kill.failed_in_flight
        kill.goal_s = RECOVERY_GOALS_S.get(kill.role)
        kill.met = kill.pid != 0 and kill.recovery_s is not None and (
            kill.goal_s is None or kill.recovery_s <= kill.goal_s)


def settle(svc: Service, timeout: float) -> tuple[bool, StatsReply | None]:
    """Wait until serve is SERVING and memsvc holds no request slots: (serving, last stats)."""
    serving = svc.wait_serving(timeout)
    try:
        return serving, svc.wait_stats(lambda st: st.slots_request == 0, timeout=min(timeout, 30.0))
    except Exception:
        return serving, None


def stop(svc: Service) -> dict[str, Any]:
    """Stop serve: its exit status and what it left behind."""
    try:
        return {"serve_exit": stop_serve(svc), "leftover": []}
    except LeftBehind as exc:
        return {"serve_exit": svc.proc.returncode, "leftover": [str(exc)]}


def request_figures(clients: Clients) -> dict[str, Any]:
    outs = clients.outcomes
    failed = Counter(o.code for o in outs if not o.ok)
    examples: dict[str, list[str]] = {}
    for o in outs:
        if not o.ok and o.details and len(examples.setdefault(o.code, [])) < 3:
            examples[o.code].append(f"{o.started:.1f} s: {o.details[:300]}")
    deadline = failed.get("DEADLINE_EXCEEDED", 0)
    sent, ok = len(outs) + len(clients.inflight), sum(o.ok for o in outs)
    return {
        "sent": sent, "succeeded": ok, "failed": dict(failed.most_common()), "failure_examples": examples,
        "hung": deadline + len(clients.hung_ids), "hung_deadline_exceeded": deadline,
        "hung_stuck": len(clients.hung_ids), "greedy_compared": sum(o.ok and o.greedy for o in outs),
        "differing": sum(o.differs for o in outs),
        "differing_examples": [o.details[:400] for o in outs if o.differs][:3],
        "availability": round(ok / sent, 4) if sent else 0.0,
    }


def memsvc_figures(watch: StatsWatch, serving: bool, st: StatsReply | None) -> dict[str, Any]:
    return {
        "serving_at_end": serving,
        "slots_leaked": st.slots_request if st is not None else None,
        "invariant_violations": watch.violations,
        "memsvc_stats": msgspec.to_builtins(st) if st is not None else None,
    }


def failures(r: dict[str, Any]) -> list[str]:
    """What misses a must-hold figure of the report."""
    out = [f"{k} = {r[k]} (must be 0)" for k in ("hung", "differing", "slots_leaked", "invariant_violations")
           if r[k] != 0]
    out += [f"leftover: {x}" for x in r["leftover"]]
    if r["availability"] < AVAILABILITY_GOAL:
        out.append(f"availability {r['availability']:.3f} < {AVAILABILITY_GOAL}")
    if not r["serving_at_end"]:
        out.append("not SERVING at the end")
    if r["serve_exit"] != 0:
        out.append(f"serve exited with {r['serve_exit']}")
    out += [f"kill of {k['role']} at {k['t_s']:.1f} s: recovery {k['recovery_s']} s, goal {k['goal_s']}"
            for k in r["kills"] if not k["met"]]
    return out


def soak(svc: Service, args: argparse.Namespace) -> dict[str, Any]:
    """References, then clients and kills for the duration, then settle: the figures."""
    channel = grpc.insecure_channel(f"127.0.0.1:{svc.port}", options=CHANNEL_OPTIONS)
    try:
        refs = references(pb_grpc.GeneratorStub(channel), prompt_pool(args.prompts), args.max_new, args.deadline_s)
        print(f"references       {len(refs)} greedy outputs of {args.max_new} tokens", flush=True)
        clients, watch = Clients(pb_grpc.GeneratorStub(channel), refs, args), StatsWatch(svc)
        clients.start()
        watch.start()
        kills = chaos(svc, clients, args)
        clients.finish()
        watch.stop()
        serving, st = settle(svc, args.settle_s)
        if st is not None:
            watch.observe(st)
    finally:
        channel.close()
    score_kills(kills, clients.outcomes)
    return (request_figures(clients) | memsvc_figures(watch, serving, st)
            | {"kills": [asdict(k) for k in kills], "killed_roles": sorted({k.role for k in kills if k.pid})})


def print_report(r: dict[str, Any]) -> None:
    rows = [("sent", r["sent"]), ("succeeded", r["succeeded"]), ("availability", f"{r['availability']:.3f}"),
            ("hung", f"{r['hung']} ({r['hung_deadline_exceeded']} deadline exceeded, {r['hung_stuck']} stuck)"),
            ("greedy compared", r["greedy_compared"]), ("greedy differing", r["differing"]),
            ("slots leaked", r["slots_leaked"]), ("invariant violations", r["invariant_violations"]),
            ("leftover", len(r["leftover"])), ("serving at end", r["serving_at_end"]),
            ("serve exit", r["serve_exit"])]
    print()
    for name, value in rows:
        print(f"{name:<22} {value}")
    for code, n in r["failed"].items():
        print(f"  failed {code:<20} {n}   {r['failure_examples'].get(code, [''])[0][:120]}")
    print(f"{'kill':<22} {'at (s)':>8} {'recovery (s)':>13} {'goal (s)':>9}  met    failed: in flight, after")
    for k in r["kills"]:
        print(f"  {k['role']:<20} {k['t_s']:>8.1f} {str(k['recovery_s']):>13} {str(k['goal_s']):>9}  {k['met']!s:<6} "
              f"{k['failed_in_flight']:>6} {k['failed_after']:>6}")
    for x in r["differing_examples"] + r["leftover"]:
        print(f"  {x}")
    print(f"log                    {r['log']}")
    print("FAILED: " + "; ".join(r["failures"]) if r["failures"] else "all figures hold")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start serve, soak it, stop it: the whole report."""
    log = Path(args.log) if args.log else Path(tempfile.mkstemp(prefix="kvserve-chaos-", suffix=".log")[1])
    head = {"command": shlex.join([sys.executable, *sys.argv]), "cpu_flags": cpu_flags(), "log": str(log),
            **{k: getattr(args, k) for k in ("model", "runners", "clients", "duration_s", "kill_every_s",
                                              "deadline_s", "max_new", "seed")}}
    print(f"command          {head['command']}\ncpu flags        {' '.join(head['cpu_flags']) or '-'}", flush=True)
    extra = ["--runners", str(args.runners), "--kv-tokens", str(args.kv_tokens)]
    extra += ["--policy", args.policy] if args.policy else []
    extra += ["--quantization", args.quantization] if args.quantization else []
    runtime = Path(tempfile.mkdtemp(prefix="kvserve-chaos-"))
    svc = start_serve(runtime, Path(args.model) if args.model else None, *extra, ready_s=args.ready_s,
                      dtype=args.dtype or None, device=args.device or None, log=log)
    try:
        figures = soak(svc, args)
    except BaseException:
        stop(svc)
        raise
    report = head | figures | stop(svc)
    if runtime.exists() and not any(runtime.iterdir()):
        runtime.rmdir()
    return report | {"failures": failures(report)}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    report = run(args)
    print_report(report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 1 if report["failures"] and not args.no_fail else 0


if __name__ == "__main__":
    sys.exit(main())
