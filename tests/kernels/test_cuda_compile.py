"""The Triton kernels compiled for real for CUDA GPUs, on any host (no GPU needed).

Every launch that `store_kv`, `decode_attention` and `extend_attention` make is captured
with the tiles their launchers choose and compiled to a cubin for sm_90 (H100/H200), sm_89
(L4, RTX 4090) and sm_80 (A100).  The interpreter tests check the arithmetic; these check what the
interpreter cannot: that the kernels pass Triton's compiler and ptxas, fit the device's
shared memory, and do not spill registers.  Running them is left to tests/kernels/test_gpu.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

triton_backends = pytest.importorskip("triton.backends")
pytestmark = pytest.mark.skipif(
    "nvidia" not in triton_backends.backends, reason="this Triton has no CUDA backend"
)

KERNEL_NAMES = {"_store_kv_kernel", "_decode_split_kernel", "_decode_merge_kernel", "_extend_kernel"}
MAX_SHARED = {80: 166912, 89: 101376, 90: 232448}  # bytes per block: A100, L4/RTX 4090, H100/H200

CASES = [
    # every model shape in bf16 on Hopper, the other dtypes on a few, then Ampere and Ada
    *[f"90:{label}:bf16" for label in ("llama3-8b", "smollm2", "qwen2-7b", "phi-2", "gqa-96", "odd-13")],
    *[f"90:{label}:{dtype}" for label in ("llama3-8b", "smollm2", "gqa-96", "odd-13")
      for dtype in ("fp16", "fp32")],
    "80:llama3-8b:bf16", "80:llama3-8b:fp32", "80:smollm2:fp32",
    "89:llama3-8b:bf16", "89:phi-2:fp32",
]


def compile_cases(cases: list[str], tmp: Path, *extra: str, workers: int = 2) -> list[dict]:
    """Compile `cases` in `workers` child processes (no TRITON_INTERPRET, a fresh cache)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp / "triton"), TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=str(ROOT))
    procs = []
    for share in (cases[i::workers] for i in range(workers)):
        if share:
            argv = [sys.executable, "-m", "tests.kernels.cuda_compile", "--json", *extra]
            argv += [arg for case in share for arg in ("--case", case)]
            procs.append(subprocess.Popen(argv, cwd=ROOT, env=env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    records = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"cuda_compile exited {proc.returncode}:\n{err[-3000:]}"
        records += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return records


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, list[dict]]:
    records = compile_cases(CASES, tmp_path_factory.mktemp("cuda"))
    by_case: dict[str, list[dict]] = {case: [] for case in CASES}
    for record in records:
        by_case[record["case"]].append(record)
    return by_case


@pytest.mark.parametrize("case", CASES)
def test_kernels_compile_within_device_limits(compiled, case):
    records = compiled[case]
    assert {r["kernel"] for r in records} == KERNEL_NAMES
    capability = int(case.split(":")[0])
    for r in records:
        where = f"{r['kernel']} {case}"
        assert "error" not in r, f"{where}: {r.get('error')}"
        assert r["spills"] == 0, f"{where}: {r['spills']} B of register spills ({r['registers']} regs)"
        assert r["shared"] <= MAX_SHARED[capability], f"{where}: {r['shared']} B shared memory"


def test_decode_split_count_is_a_runtime_argument(compiled):
    # A new split count must not mean a new kernel: the heuristic picks 1..32 per step.
    split = [r for r in compiled[CASES[0]] if r["kernel"] == "_decode_split_kernel"]
    assert split and "NUM_SPLITS" not in split[0]["constexprs"]


def test_a_spilling_tile_is_caught(tmp_path):
    # The check can fail: an fp32 extend kernel with a key block too large for registers.
    records = compile_cases(["90:llama3-8b:fp32"], tmp_path, "--override",
                            "_extend_kernel:BLOCK_N=64", "--override", "_extend_kernel:num_warps=4",
                            "--only", "_extend_kernel", workers=1)
    extend = [r for r in records if r["kernel"] == "_extend_kernel"]
    assert extend and extend[0]["spills"] > 0
