"""The frontend's view of the runner workers: who is live, how loaded, who runs what.

Pure bookkeeping (no sockets, no clocks of its own): the frontend feeds it `Hello` and
`RunnerStatus` messages with timestamps, asks `pick()` for the least-loaded live runner,
and calls `reap(now)` to find runners that went silent or whose pid is gone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.messages.frontend_runner import RUNNER_TIMEOUT_S, Hello, RunnerStatus
from kvserve.procs import pid_alive


@dataclass(slots=True)
class RunnerState:
    """One connected runner as the frontend last heard from it."""

    runner_id: str
    pid: int
    max_context_len: int
    last_seen: float
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    memsvc_ok: bool = True
    inflight: set[str] = field(default_factory=set)

    def load(self) -> tuple[int, float]:
        """Sort key: requests we sent it (fresher than its status), then KV usage."""
        return max(len(self.inflight), self.running + self.waiting), self.kv_usage


@dataclass(slots=True)
class Router:
    """Runner registry with liveness and least-loaded routing."""

    timeout_s: float = RUNNER_TIMEOUT_S
    is_alive: Callable[[int], bool] = pid_alive
    runners: dict[str, RunnerState] = field(default_factory=dict)
    owner: dict[str, str] = field(default_factory=dict)  # request_id -> runner_id

    def hello(self, msg: Hello, now: float) -> set[str]:
        """Register (or re-register) a runner; return request_ids lost if it is a new incarnation."""
        old = self.runners.get(msg.runner_id)
        lost: set[str] = set()
        if old is not None and old.pid != msg.pid:
            lost = self._drop(msg.runner_id)
        elif old is not None:
            old.last_seen = now
            return lost
        self.runners[msg.runner_id] = RunnerState(
            runner_id=msg.runner_id, pid=msg.pid, max_context_len=msg.max_context_len, last_seen=now,
        )
        return lost

    def status(self, msg: RunnerStatus, now: float) -> bool:
        """Update a runner's load; False when the runner never said Hello (ignored)."""
        st = self.runners.get(msg.runner_id)
        if st is None:
            return False
        st.last_seen = now
        st.running, st.waiting, st.kv_usage, st.memsvc_ok = msg.running, msg.waiting, msg.kv_usage, msg.memsvc_ok
        return True

    def seen(self, runner_id: str, now: float) -> None:
        """Any message from a runner proves it is alive."""
        st = self.runners.get(runner_id)
        if st is not None:
            st.last_seen = now

    def reap(self, now: float) -> dict[str, set[str]]:
        """Remove runners silent for `timeout_s` or whose pid is gone; return {runner_id: lost request_ids}."""
        dead = [
            runner_id for runner_id, st in self.runners.items()
            if now - st.last_seen > self.timeout_s or not self.is_alive(st.pid)
        ]
        return {runner_id: self._drop(runner_id) for runner_id in dead}

    def _drop(self, runner_id: str) -> set[str]:
        st = self.runners.pop(runner_id)
        for request_id in st.inflight:
            self.owner.pop(request_id, None)
        return set(st.inflight)

    def live(self) -> list[RunnerState]:
        return list(self.runners.values())

    def pick(self, exclude: frozenset[str] = frozenset()) -> RunnerState | None:
        """The least-loaded live runner (memsvc attached preferred), or None."""
        cands = [st for st in self.runners.values() if st.runner_id not in exclude]
        if not cands:
            return None
        return min(cands, key=lambda st: (not st.memsvc_ok, *st.load(), st.runner_id))

    def assign(self, request_id: str, runner_id: str) -> None:
        self.runners[runner_id].inflight.add(request_id)
        self.owner[request_id] = runner_id

    def release(self, request_id: str) -> str | None:
        """Forget a finished request; return the runner that ran it (if still known)."""
        runner_id = self.owner.pop(request_id, None)
        if runner_id is not None and runner_id in self.runners:
            self.runners[runner_id].inflight.discard(request_id)
        return runner_id

    def context_len(self, default: int) -> int:
        """The smallest context length among live runners (or `default` with none)."""
        lens = [st.max_context_len for st in self.runners.values() if st.max_context_len > 0]
        return min([default, *lens]) if lens else default
