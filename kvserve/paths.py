"""Where kvserve keeps sockets and cached model files on this host."""

from __future__ import annotations

import os
import stat
from pathlib import Path


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


def cache_dir() -> Path:
    """Return the model cache directory: $KVSERVE_CACHE_DIR or ~/.cache/kvserve."""
    base = os.environ.get("KVSERVE_CACHE_DIR") or Path.home() / ".cache" / "kvserve"
    path = Path(base)
    path.mkdir(parents=True, exist_ok=True)
    return path
