"""The runner's frontend link: one DEALER socket shared by the worker loop and the status thread.

`FrontendLink` is the half of `Worker` that owns the socket's traffic: `_send` (one message
up, with a deadline), `_receive` (the loop's wait for frames), and the status thread
(`_status_loop`), which sends `RunnerStatus` every `STATUS_INTERVAL_S` even while a long
forward runs and the `Hello` again every `HELLO_INTERVAL_S`. The lock that guards the socket
is unfair, so a status send that waits for it sets `_aside` and the idle loop stands aside
(a starved status thread got idle runners dropped). If the status thread dies, it records
the error in `fatal` and stops the worker.

This module knows the frontend↔runner messages and the socket; it does not know the model,
memsvc, or how a taken frame is scheduled (`Worker.take_frame`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import zmq

from kvserve.config.runner import RunnerConfig
from kvserve.messages.frontend_runner import (
    HELLO_INTERVAL_S,
    STATUS_INTERVAL_S,
    UP,
    Hello,
    RunnerStatus,
)

log = logging.getLogger("kvserve.runner")

IDLE_POLL_MS = 50


class FrontendLink:
    """The socket traffic of `Worker`, which sets these attributes in its constructor."""

    cfg: RunnerConfig
    stopping: threading.Event
    lock: threading.Lock  # guards the frontend socket (status thread + loop)
    _aside: threading.Event  # set while the status thread waits for the socket
    _sock: zmq.Socket | None
    sched: Any
    mem: Any
    fatal: BaseException | None

    def take_frame(self, frame: bytes) -> None:
        """Take one frame from the frontend (the worker's)."""
        raise NotImplementedError

    def _send(self, msg: Any, wait_s: float = 0.0, *, aside: bool = False) -> bool:
        """Send one message up; False when the frontend cannot take it within `wait_s`.
        `aside`: sent from a thread other than the loop's, which lets it have the socket."""
        assert self._sock is not None
        frame = UP.encode(msg)
        if aside:
            self._aside.set()
        with self.lock:
            self._aside.clear()
            if wait_s and not self._sock.poll(int(wait_s * 1000), zmq.POLLOUT):
                return False
            try:
                self._sock.send(frame, flags=zmq.NOBLOCK)
                return True
            except zmq.Again:
                return False

    def _hello(self, aside: bool = False) -> None:
        self._send(Hello(runner_id=self.cfg.runner_id, pid=os.getpid(),
                         max_context_len=self.sched.max_context_len), aside=aside)

    def _status(self) -> RunnerStatus:
        s, mem = self.sched, self.mem
        return RunnerStatus(runner_id=self.cfg.runner_id, running=s.num_running, waiting=s.num_waiting,
                            kv_usage=float(mem.kv_usage()) if mem is not None else 0.0,
                            memsvc_ok=mem is not None)

    def _status_loop(self) -> None:
        """RunnerStatus every ~0.2 s, and the Hello again every HELLO_INTERVAL_S: a frontend
        that restarted (or dropped this runner after a stall) registers it again; one that
        knows this pid only refreshes it."""
        last_hello = time.monotonic()
        try:
            while not self.stopping.wait(STATUS_INTERVAL_S * 0.8):
                self._send(self._status(), aside=True)  # one that does not fit is replaced soon
                if time.monotonic() - last_hello >= HELLO_INTERVAL_S:
                    self._hello(aside=True)
                    last_hello = time.monotonic()
        except BaseException as exc:  # a silent runner would be dropped anyway: die loudly
            log.critical("the status thread died: %r", exc, exc_info=exc)
            self.fatal = exc
            self.stopping.set()

    def _receive(self, timeout_ms: int) -> None:
        """Wait up to `timeout_ms` for frames from the frontend, then take all that are there."""
        assert self._sock is not None
        frames = []
        with self.lock:
            if self._sock.poll(timeout_ms):
                while True:
                    try:
                        frames.append(self._sock.recv(flags=zmq.NOBLOCK))
                    except zmq.Again:
                        break
        end = time.monotonic() + IDLE_POLL_MS / 1000  # a waiter is woken well within a poll
        while self._aside.is_set() and time.monotonic() < end:
            time.sleep(0.0002)  # the status thread takes the socket now
        for frame in frames:
            self.take_frame(frame)
