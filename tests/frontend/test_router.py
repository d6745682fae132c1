"""Runner registry: least-loaded routing, liveness by silence and by pid, re-incarnation."""

from __future__ import annotations

from kvserve.frontend.router import Router
from kvserve.messages.frontend_runner import Hello, RunnerStatus


def _hello(runner_id: str, pid: int = 10) -> Hello:
    return Hello(runner_id=runner_id, pid=pid, max_context_len=100)


def test_picks_least_loaded_and_counts_inflight() -> None:
    r = Router(timeout_s=1.0, is_alive=lambda pid: True)
    r.hello(_hello("a"), 0.0)
    r.hello(_hello("b"), 0.0)
    r.status(RunnerStatus(runner_id="a", running=3, waiting=1, kv_usage=0.5), 0.1)
    assert r.pick().runner_id == "b"
    for i in range(5):
        r.assign(f"x{i}", "b")
    assert r.pick().runner_id == "a"
    assert r.release("x0") == "b"
    assert r.pick(exclude=frozenset({"a"})).runner_id == "b"


def test_runner_without_memsvc_is_last_choice() -> None:
    r = Router(is_alive=lambda pid: True)
    r.hello(_hello("a"), 0.0)
    r.hello(_hello("b"), 0.0)
    r.status(RunnerStatus(runner_id="a", running=0, waiting=0, kv_usage=0.0, memsvc_ok=False), 0.0)
    r.assign("x", "b")
    assert r.pick().runner_id == "b"


def test_reap_by_silence_and_by_pid() -> None:
    dead_pids = {20}
    r = Router(timeout_s=1.0, is_alive=lambda pid: pid not in dead_pids)
    r.hello(_hello("quiet", pid=10), 0.0)
    r.hello(_hello("killed", pid=20), 0.9)
    r.assign("q1", "quiet")
    lost = r.reap(1.5)
    assert lost == {"quiet": {"q1"}, "killed": set()}
    assert r.pick() is None and r.owner == {}


def test_new_incarnation_loses_old_requests() -> None:
    r = Router(is_alive=lambda pid: True)
    r.hello(_hello("a", pid=1), 0.0)
    r.assign("x", "a")
    assert r.hello(_hello("a", pid=1), 0.1) == set()
    assert r.hello(_hello("a", pid=2), 0.2) == {"x"}
    assert r.runners["a"].inflight == set()


def test_context_len_is_smallest_of_runners() -> None:
    r = Router(is_alive=lambda pid: True)
    assert r.context_len(2048) == 2048
    r.hello(_hello("a"), 0.0)
    assert r.context_len(2048) == 100
