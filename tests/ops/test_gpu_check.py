"""The dry run of `make gpu-check` on CPU: the same script and stages a GPU host runs, with
`--device cpu` (the tiny model served by two CPU runners, HF parity, kill -9 of a runner,
the kernel benchmark's tiny shapes in Triton's interpreter; the throughput stage skipped),
so that a first GPU run cannot fail on a typo, a missing file or a wrong path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKS = (
    "two runners live",
    "runners on the device",
    "kvserve --device cpu --runners 2 == HF on cpu",
    "the prefix prompt before the kill",
    "all 16 streaming on both runners before the kill",
    "exactly the killed runner's streams fail UNAVAILABLE",
    "the killed runner is restarted",
    "after the restart, prompts on the cached prefix == HF",
    "the prefix cached before the kill is hit",
    "the restarted runner served some of them",
    "serve stops cleanly",
)


@pytest.mark.timeout(420)
def test_gpu_check_dry_run_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = dict(os.environ, PY=sys.executable, OUT=str(out))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(["bash", "bench/gpu_check.sh", "--device", "cpu"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=400)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    result = json.loads((out / "correctness.json").read_text())
    assert result["ok"] is True and result["device"] == "cpu"
    assert set(result["checks"]) == set(CHECKS), sorted(result["checks"])
    assert all(c["ok"] for c in result["checks"].values()), result["checks"]
    assert "stage throughput: needs CUDA, skipped in the dry run" in log
    assert "stage kernel-bench exit 0" in log and "decode (split-KV)" in (out / "kernels.txt").read_text()
    files = sorted(p.name for p in out.iterdir())
    assert files == ["correctness.json", "device.txt", "gpu_check.log", "kernels.txt", "serve.log"]


def test_gpu_check_refuses_an_unknown_argument() -> None:
    proc = subprocess.run(["bash", "bench/gpu_check.sh", "--devcie", "cpu"], cwd=ROOT,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert "unknown argument --devcie" in proc.stderr
