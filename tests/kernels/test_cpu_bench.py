"""bench/cpu_attention.py: slot layouts, a quick end-to-end run, bad-argument exit."""

from __future__ import annotations

import pytest
import torch

from .conftest import bench_script


@pytest.fixture(scope="module")
def bench():
    with bench_script("cpu_attention") as module:
        yield module


@pytest.mark.parametrize("layout", ["chunked", "contiguous", "scattered"])
def test_slot_layouts_are_distinct_real_slots(bench, layout):
    case = bench.Case("x", 3, 150, 1)
    table = bench.slot_table(case, layout, 16, torch.Generator().manual_seed(0))
    assert table.shape == (3, 151)
    flat = table.flatten()
    assert flat.unique().numel() == flat.numel() and int(flat.min()) == 1
    runs = int((table[:, 1:] - table[:, :-1] != 1).sum())
    expected = {"contiguous": 0, "chunked": 3 * 2}.get(layout)
    if expected is not None:
        assert runs == expected  # chunked: prompt run of 128, then chunks 16 + 7 interleaved


def test_quick_run_prints_table(bench, capsys):
    assert bench.main(["--quick", "--dtypes", "float32", "--threads", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "torch/sdpa" in lines[1]
    assert [line.split()[0] for line in lines[3:]] == ["decode", "prefill"]


def test_bad_dtype_exits_2(bench, capsys):
    assert bench.main(["--quick", "--dtypes", "float8"]) == 2
    assert "unknown dtype" in capsys.readouterr().err
