"""systemd notify protocol (sd_notify) without libsystemd: one datagram per message.

Does nothing when $NOTIFY_SOCKET is unset, so every process can call it unconditionally.
"""

from __future__ import annotations

import os
import socket


def notify(message: str) -> bool:
    """Send `message` (e.g. "READY=1", "WATCHDOG=1", "STOPPING=1"); True if it was sent."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    if path.startswith("@"):
        path = "\0" + path[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(path)
            sock.sendall(message.encode())
        return True
    except OSError:
        return False


def watchdog_interval_s() -> float | None:
    """Half of $WATCHDOG_USEC in seconds (how often to send WATCHDOG=1), or None."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid.isdigit() and int(pid) != os.getpid()):
        return None
    try:
        return max(int(usec) / 2e6, 0.05)
    except ValueError:
        return None
