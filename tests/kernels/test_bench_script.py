"""CPU-checkable parts of bench/gpu_kernels.py: arguments, peak lookup, table, no-GPU exit."""

from __future__ import annotations

import pytest
import torch

from .conftest import bench_script


@pytest.fixture(scope="module")
def bench():
    with bench_script("gpu_kernels") as module:
        yield module


def test_peak_by_name(bench):
    assert bench.peak_bandwidth("NVIDIA H200", None) == 4.8
    assert bench.peak_bandwidth("NVIDIA H100 80GB HBM3", None) == 3.35
    assert bench.peak_bandwidth("NVIDIA H100 PCIe", None) == 2.0
    assert bench.peak_bandwidth("Mystery GPU", None) is None
    assert bench.peak_bandwidth("NVIDIA H200", 1.5) == 1.5


def test_table_and_args(bench):
    table = bench.format_table(["a", "bbb"], [["1", "2"], ["333", "4"]])
    assert table.splitlines() == ["  a  bbb", "---  ---", "  1    2", "333    4"]
    args = bench.parse_args(["--dry-run", "--iters", "3", "--peak-tbps", "2.5"])
    assert args.dry_run and args.iters == 3 and args.peak_tbps == 2.5


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_exits_without_gpu(bench, capsys):
    assert bench.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err
