"""Where kvserve keeps sockets and cached model files on this host, and how a socket file is
bound owner-only.

Standard library only: the ZMQ socket `bind_private` takes is any object with `bind()`.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Protocol

MEMSVC_SOCKET = "memsvc.sock"
FRONTEND_SOCKET = "frontend.sock"


def runtime_dir(explicit: str | os.PathLike | None = None) -> Path:
    """Return the owner-only directory for ipc:// sockets, creating it (mode 0700).

    Order: `explicit`, $KVSERVE_RUNTIME_DIR, $RUNTIME_DIRECTORY (systemd), $XDG_RUNTIME_DIR/kvserve,
    /tmp/kvserve-<uid>. A directory owned by someone else or open to others is refused.
    """
    base = (
        explicit
        or os.environ.get("KVSERVE_RUNTIME_DIR")
        or os.environ.get("RUNTIME_DIRECTORY")
        or (Path(os.environ["XDG_RUNTIME_DIR"]) / "kvserve" if os.environ.get("XDG_RUNTIME_DIR") else None)
        or f"/tmp/kvserve-{os.getuid()}"
    )
    path = Path(base)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"runtime dir {path} is not a directory")
    if st.st_uid != os.getuid():
        raise PermissionError(f"runtime dir {path} is owned by uid {st.st_uid}, not {os.getuid()}")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def ipc_address(name: str, explicit_dir: str | os.PathLike | None = None) -> str:
    """``ipc://<runtime dir>/<name>``, the default address of a kvserve socket
    (`MEMSVC_SOCKET`, `FRONTEND_SOCKET`); the runtime dir as `runtime_dir` finds it."""
    return f"ipc://{runtime_dir(explicit_dir) / name}"


class Bindable(Protocol):
    def bind(self, address: str) -> object: ...


def bind_private(sock: Bindable, address: str) -> Path | None:
    """Bind `sock` to `address`; an ipc:// socket file is created owner-only (0600, in a
    0700 directory, never readable by others even for an instant). Returns the socket
    file's path (None for tcp://)."""
    if not address.startswith("ipc://"):
        sock.bind(address)
        return None
    path = Path(address[len("ipc://"):])
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    old = os.umask(0o177)
    try:
        sock.bind(address)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    return path


def cache_dir() -> Path:
    """Return the model cache directory: $KVSERVE_CACHE_DIR or ~/.cache/kvserve."""
    base = os.environ.get("KVSERVE_CACHE_DIR") or Path.home() / ".cache" / "kvserve"
    path = Path(base)
    path.mkdir(parents=True, exist_ok=True)
    return path
