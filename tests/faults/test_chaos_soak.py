"""The 1-minute chaos soak: `bench/chaos_soak.py` on the tiny model with `--runners 2`, a
kill -9 of frontend, memsvc or a runner every 15 s (one of each role: the soak draws them
from a shuffled cycle), run once as a subprocess; each test checks one must-hold figure of
its JSON report, so a failure names the figure. Each role recovers within 2.5 s of its kill
on this tiny model (memsvc the slowest), so 15 s between kills leaves the service serving
most of every interval, as the 30 s of `bench/chaos_soak.py`'s default do.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(600)  # the first test pays for the whole soak

ROOT = Path(__file__).resolve().parents[2]
DURATION_S = 60
KILL_EVERY_S = 15
SOAK_TIMEOUT_S = 540


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("chaos")
    cmd = [sys.executable, str(ROOT / "bench" / "chaos_soak.py"), "--duration-s", str(DURATION_S),
           "--kill-every-s", str(KILL_EVERY_S), "--model", str(tiny_model), "--ready-s", "300",
           "--dtype", "", "--quantization", "int4",  # the default path (harness.DEFAULT_PATH)
           "--json", str(out / "report.json"), "--log", str(out / "serve.log"), "--no-fail"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=SOAK_TIMEOUT_S)
    print(proc.stdout, proc.stderr[-4000:], sep="\n")
    assert proc.returncode == 0, f"the soak did not run to its end: {proc.stderr[-2000:]}"
    return json.loads((out / "report.json").read_text())


def test_no_request_hung(report: dict[str, Any]) -> None:
    assert report["hung"] == 0, (report["hung_deadline_exceeded"], report["hung_stuck"])


def test_greedy_outputs_match_the_fault_free_reference(report: dict[str, Any]) -> None:
    assert report["greedy_compared"] > 0
    assert report["differing"] == 0, report["differing_examples"]


def test_no_slot_leaked(report: dict[str, Any]) -> None:
    assert report["slots_leaked"] == 0, report["memsvc_stats"]


def test_no_invariant_violation(report: dict[str, Any]) -> None:
    assert report["invariant_violations"] == 0


def test_nothing_left_behind(report: dict[str, Any]) -> None:
    assert report["leftover"] == []
    assert report["serve_exit"] == 0


def test_serving_at_the_end(report: dict[str, Any]) -> None:
    assert report["serving_at_end"]


def test_availability(report: dict[str, Any]) -> None:
    assert report["availability"] >= 0.90, (report["sent"], report["succeeded"], report["failed"])


def test_every_role_killed(report: dict[str, Any]) -> None:
    assert set(report["killed_roles"]) == {"frontend", "memsvc", "runner"}, report["kills"]


@pytest.mark.parametrize("role", ["frontend", "memsvc", "runner"])
def test_recovery_goal(report: dict[str, Any], role: str) -> None:
    kills = [k for k in report["kills"] if k["role"] == role]
    assert kills, f"no kill of {role}"
    assert all(k["met"] for k in kills), kills
