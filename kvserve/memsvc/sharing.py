"""Buffer sharing between memsvc and runners: memfd on CPU, CUDA IPC handles on GPU.

CPU: memsvc creates one anonymous `memfd` per buffer (``os.memfd_create``, close-on-exec)
and maps it. A runner on the same host maps the same memory by opening
``/proc/<memsvc pid>/fd/<fd>``. Nothing is ever named in /dev/shm or on disk: the kernel
frees the memory when the last process holding a mapping or the fd goes away, so a
``kill -9`` of any process leaks nothing. (The runner must run as the same user as
memsvc, which the owner-only ipc:// socket already requires.)

GPU: memsvc allocates plain ``cudaMalloc`` tensors through torch and exports them with
torch's CUDA IPC reduction; only the bytes and ints of that export cross the socket (no
pickle). A runner opens each handle once.

This module knows nothing about pools, allocation or the wire beyond `BufferHandle`.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from kvserve.messages.runner_memsvc import BufferHandle, CudaHandle

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a dtype name; ValueError naming the allowed ones."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(DTYPES)}") from None


class SharedBuffer:
    """One buffer memsvc owns and exports. `tensor` is memsvc's own view of it."""

    def __init__(self, name: str, shape: tuple[int, ...], dtype: str, device: str) -> None:
        self.name = name
        self.shape = tuple(shape)
        self.dtype = dtype
        self.device = torch.device(device)
        tdtype = torch_dtype(dtype)
        numel = math.prod(self.shape)
        self.nbytes = numel * tdtype.itemsize
        self.fd = -1
        if self.device.type == "cpu":
            self.fd = os.memfd_create(f"kvserve-{name}", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, self.nbytes)
            flat = torch.from_file(f"/proc/self/fd/{self.fd}", shared=True, size=numel, dtype=tdtype)
            self.tensor = flat.view(self.shape)
        elif self.device.type == "cuda":
            self.tensor = torch.zeros(self.shape, dtype=tdtype, device=self.device)
        else:
            raise ValueError(f"device {device!r}: only cpu and cuda pools are supported")

    def handle(self) -> BufferHandle:
        """What a runner needs to map this buffer."""
        if self.fd >= 0:
            return BufferHandle(name=self.name, kind="memfd", shape=list(self.shape),
                                dtype=self.dtype, nbytes=self.nbytes, pid=os.getpid(), fd=self.fd)
        return BufferHandle(name=self.name, kind="cuda", shape=list(self.shape), dtype=self.dtype,
                            nbytes=self.nbytes, pid=os.getpid(), cuda=_export_cuda(self.tensor))

    def close(self) -> None:
        """Drop memsvc's fd; the memory lives on only while some process maps it. CUDA: remove
        the IPC files of this process in /dev/shm (`remove_cuda_ipc_files`)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.device.type == "cuda":
            remove_cuda_ipc_files(os.getpid())


def remove_cuda_ipc_files(pid: int, shm: Path = Path("/dev/shm")) -> list[str]:
    """Remove the `cuda.shm.<device>.<pid in hex>.<n>` files the CUDA driver made in /dev/shm
    for `pid`'s exported IPC events; the names removed. The driver leaves them behind when
    the exporting process ends (seen on an H200, driver 580: one per memsvc run), so memsvc
    removes its own when it stops: nobody opens its handles any more then, and a runner that
    still maps a buffer keeps its mapping. (After a kill -9 of memsvc one such file, a few
    KiB, stays.)"""
    removed = []
    for path in shm.glob(f"cuda.shm.*.{pid:x}.*"):
        parts = path.name.split(".")
        if len(parts) == 5 and parts[3] == f"{pid:x}" and parts[2].isdigit() and parts[4].isdigit():
            try:
                path.unlink()
                removed.append(path.name)
            except OSError:
                pass
    return removed


def _export_cuda(tensor: torch.Tensor) -> CudaHandle:
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(tensor)
    (_, _, _, _, _, _, device, handle, size_bytes, offset_bytes, _,
     ref_handle, ref_offset, event_handle, event_sync) = args
    return CudaHandle(device=int(device), handle=bytes(handle), storage_size_bytes=int(size_bytes),
                      storage_offset_bytes=int(offset_bytes), ref_counter_handle=bytes(ref_handle),
                      ref_counter_offset=int(ref_offset), event_handle=bytes(event_handle or b""),
                      event_sync_required=bool(event_sync))


def open_buffer(handle: BufferHandle) -> torch.Tensor:
    """Map a buffer exported by memsvc into this process (once per process and buffer)."""
    tdtype = torch_dtype(handle.dtype)
    numel = math.prod(handle.shape)
    if numel * tdtype.itemsize != handle.nbytes:
        raise ValueError(f"buffer {handle.name}: shape {handle.shape} does not match {handle.nbytes} bytes")
    if handle.kind == "memfd":
        path = f"/proc/{handle.pid}/fd/{handle.fd}"
        try:
            flat = torch.from_file(path, shared=True, size=numel, dtype=tdtype)
        except RuntimeError as exc:
            raise OSError(f"cannot map {handle.name} from {path} (memsvc on another host or "
                          f"user?): {exc}") from None
        return flat.view(handle.shape)
    if handle.kind == "cuda" and handle.cuda is not None:
        if not torch.cuda.is_available():
            raise OSError(f"buffer {handle.name} is on CUDA but this process has no CUDA device")
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        c = handle.cuda
        stride = [math.prod(handle.shape[i + 1:]) for i in range(len(handle.shape))]
        return rebuild_cuda_tensor(
            torch.Tensor, torch.Size(handle.shape), tuple(stride), 0, torch.storage.TypedStorage,
            tdtype, c.device, c.handle, c.storage_size_bytes, c.storage_offset_bytes, False,
            c.ref_counter_handle, c.ref_counter_offset, c.event_handle or None, c.event_sync_required,
        )
    raise ValueError(f"buffer {handle.name}: unknown kind {handle.kind!r}")
