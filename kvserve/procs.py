"""Whether a local process is still alive: the one check every kvserve process makes of
its peers (memsvc of its runners' pids, runners of memsvc's, the frontend of its runners').

Knows nothing about kvserve's processes; imports only the standard library.
"""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True when `pid` exists on this host and is not a zombie (pid <= 0: unknown, True)."""
    if pid <= 0:
        return True  # unknown (e.g. a remote peer): rely on timeouts
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # no such process; a pid past the C int range
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return True
