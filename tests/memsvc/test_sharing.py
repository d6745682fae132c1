"""memsvc's buffer sharing without a GPU: memfd buffers and the CUDA IPC files it removes."""

from __future__ import annotations

from pathlib import Path

import torch

from kvserve.memsvc.sharing import SharedBuffer, open_buffer, remove_cuda_ipc_files


def test_memfd_buffer_is_the_same_memory_in_another_mapping() -> None:
    buf = SharedBuffer("k_buffer", (2, 8, 3), "float32", "cpu")
    try:
        other = open_buffer(buf.handle())
        buf.tensor.fill_(3.0)
        assert torch.equal(other, torch.full((2, 8, 3), 3.0))
    finally:
        buf.close()


def test_only_this_processes_cuda_ipc_files_are_removed(tmp_path: Path) -> None:
    pid = 0x242
    mine = ["cuda.shm.0.242.1", "cuda.shm.1.242.7"]
    others = ["cuda.shm.0.2420.1", "cuda.shm.0.1242.1", "cuda.shm.0.243.1", "torch_242_1",
              "cuda.shm.x.242.1", "cuda.shm.0.242.1.tmp"]
    for name in mine + others:
        (tmp_path / name).write_bytes(b"x")
    assert sorted(remove_cuda_ipc_files(pid, tmp_path)) == mine
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(others)
