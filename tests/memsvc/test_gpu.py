"""CUDA IPC sharing: a second process opens memsvc's cudaMalloc buffer (skipped without CUDA)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CHILD = """
import sys, torch
from kvserve.messages.runner_memsvc import REPLIES
from kvserve.memsvc.sharing import open_buffer
reply = REPLIES.decode(sys.stdin.buffer.read())
t = open_buffer(reply.buffers[0])
print(float(t.sum()), flush=True)
t.fill_(2.0)
torch.cuda.synchronize()
"""


@pytest.mark.timeout(120)
def test_cuda_buffer_shared_with_another_process() -> None:
    from kvserve.memsvc.sharing import SharedBuffer
    from kvserve.messages.runner_memsvc import REPLIES, AttachReply, Layout

    buf = SharedBuffer("k_buffer", (2, 16, 2, 8), "float32", "cuda:0")
    buf.tensor.fill_(1.0)
    torch.cuda.synchronize()
    layout = Layout(2, 2, 8, "float32", 16, 1, 1, 1, "cuda:0", "reserve", 1)
    frame = REPLIES.encode(AttachReply(lease=1, layout=layout, buffers=[buf.handle()]))
    out = subprocess.run([sys.executable, "-c", CHILD], input=frame, capture_output=True, timeout=100)
    assert out.returncode == 0, out.stderr.decode()
    assert float(out.stdout.decode().strip()) == 2 * 16 * 2 * 8
    assert float(buf.tensor.sum()) == 2.0 * 2 * 16 * 2 * 8
