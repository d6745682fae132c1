"""A load driver shared by the fault tests' load test and `bench/soak.py`: N client threads sending random
prompts with random sampling parameters, cancelling, aborting and using short deadlines.

`run_load(stub, clients, seconds, seed)` returns a `LoadResult` (status counts, requests,
elapsed, unexpected outcomes). Unexpected: a status other than OK, CANCELLED or
DEADLINE_EXCEEDED, a bad final message, or a stream that ends OK without a final message
carrying a finish_reason (unless the client cancelled it itself). Knows the gRPC API only.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from kvserve.v1 import generator_pb2 as pb
from kvserve.v1 import generator_pb2_grpc as pb_grpc

OK_REASONS = {"length", "stop", "abort"}
EXPECTED = {grpc.StatusCode.OK, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}
ACTIONS = ("run", "run", "cancel", "deadline", "abort")
ALPHABET = "abcdefgh ijklmnop,.\u00e9\u4e2d"
SHARED_PREFIX = "A shared system prefix for the load test. "


@dataclass
class LoadResult:
    """What a load run saw: `statuses` maps "action:status" to a count."""

    clients: int
    elapsed_s: float = 0.0
    statuses: Counter = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return sum(self.statuses.values())

    @property
    def rate(self) -> float:
        return self.requests / self.elapsed_s if self.elapsed_s else 0.0


def random_request(rng: random.Random, request_id: str, max_new: int = 40) -> pb.GenerateRequest:
    """A valid request with random text (bytes of several UTF-8 widths) and sampling."""
    s = pb.SamplingParams(max_new_tokens=rng.randint(1, max_new), ignore_eos=rng.random() < 0.5)
    if rng.random() < 0.6:
        s.temperature, s.top_p, s.top_k = rng.choice([0.5, 0.9, 1.3]), rng.uniform(0.3, 1.0), rng.randint(0, 50)
        s.min_p, s.seed = rng.choice([0.0, 0.05]), rng.randint(0, 2**63)
    if rng.random() < 0.3:
        s.repetition_penalty, s.presence_penalty, s.frequency_penalty = 1.1, 0.3, 0.2
    if rng.random() < 0.2:
        s.stop.append(rng.choice(["a", "e ", "th"]))
    s.logprobs = rng.choice([0, 0, 2])
    text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 120)))
    if rng.random() < 0.2:
        text = SHARED_PREFIX + text
    return pb.GenerateRequest(text=text, sampling=s, request_id=request_id)


def _one(stub: pb_grpc.GeneratorStub, rng: random.Random, request_id: str, max_new: int) -> tuple[str, str]:
    """Run one request with a random action; returns (key, problem or "")."""
    req = random_request(rng, request_id, max_new)
    action = rng.choice(ACTIONS)
    timeout = rng.uniform(0.05, 0.6) if action == "deadline" else 120.0
    call = stub.Generate(req, timeout=timeout)
    stop_after = rng.randint(1, 5)
    got = 0
    final = ""
    try:
        for msg in call:
            got += 1
            if msg.finish_reason and (msg.finish_reason not in OK_REASONS
                                      or msg.usage.completion_tokens > req.sampling.max_new_tokens):
                return f"{action}:OK", f"bad final message {msg.finish_reason} {msg.usage}"
            final = final or msg.finish_reason
            if got == stop_after and action == "cancel":
                call.cancel()
            if got == stop_after and action == "abort":
                stub.Abort(pb.AbortRequest(request_id=request_id), timeout=10)
        cancelled = action == "cancel" and got >= stop_after
        if not final and not cancelled:
            return f"{action}:OK", f"stream ended OK after {got} message(s) without a finish_reason"
        return f"{action}:OK", ""
    except grpc.RpcError as exc:
        problem = "" if exc.code() in EXPECTED else f"{exc.code().name}: {exc.details()}"
        return f"{action}:{exc.code().name}", problem


def run_load(stub: pb_grpc.GeneratorStub, clients: int, seconds: float, seed: int = 0,
             max_new: int = 40, tick: Callable[[], None] | None = None) -> LoadResult:
    """Drive `clients` threads for `seconds`; call `tick()` about twice a second meanwhile."""
    result = LoadResult(clients=clients)
    lock = threading.Lock()
    until = time.monotonic() + seconds

    def client(k: int) -> None:
        rng = random.Random(seed * 1000 + k)
        i = 0
        while time.monotonic() < until:
            i += 1
            key, problem = _one(stub, rng, f"load-{seed}-{k}-{i}", max_new)
            with lock:
                result.statuses[key] += 1
                if problem:
                    result.unexpected.append(problem)

    start = time.monotonic()
    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        if tick is not None:
            tick()
        time.sleep(0.5)
    result.elapsed_s = time.monotonic() - start
    return result
