"""The runner's status thread gets the frontend socket while the loop idles.

The idle loop holds the socket's lock through each 50 ms poll and takes it again at once;
a plain lock does not queue its waiters, so the status thread could lose every round (on
a 16-core VM it did for a minute at a time, and the frontend dropped the idle runners).
Here the loop runs `Worker._receive` back to back on a real DEALER socket while the status
thread sends 20 statuses the way `_status_loop` does: each must get the socket before the
loop polls again, i.e. the loop never takes the lock twice while a status waits.
"""

from __future__ import annotations

import threading
import time

import zmq

from kvserve.config.runner import RunnerConfig
from kvserve.messages.frontend_runner import RunnerStatus
from kvserve.runner.worker import Worker


class CountingLock:
    """A lock that counts how often the loop thread took it while `waiting` was set."""

    def __init__(self) -> None:
        self.inner = threading.Lock()
        self.waiting = threading.Event()
        self.loop_ident = threading.get_ident()
        self.loop_takes_while_waiting = 0

    def __enter__(self) -> CountingLock:
        self.inner.acquire()
        if threading.get_ident() == self.loop_ident and self.waiting.is_set():
            self.loop_takes_while_waiting += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self.inner.release()


def test_status_sends_are_not_starved_by_the_idle_loop(tmp_path) -> None:
    worker = Worker(RunnerConfig(runtime_dir=str(tmp_path), device="cpu"))
    router = worker._ctx.socket(zmq.ROUTER)
    router.bind(f"ipc://{tmp_path}/f.sock")
    dealer = worker._ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"runner-0")
    dealer.connect(f"ipc://{tmp_path}/f.sock")
    worker._sock = dealer
    lock = CountingLock()
    worker.lock = lock  # type: ignore[assignment]
    waits: list[float] = []
    done = threading.Event()

    def status() -> None:
        for _ in range(20):
            time.sleep(0.05)
            lock.waiting.set()
            t0 = time.monotonic()
            worker._send(RunnerStatus(runner_id="runner-0", running=0, waiting=0, kv_usage=0.0,
                                      memsvc_ok=True), aside=True)
            waits.append(time.monotonic() - t0)
            lock.waiting.clear()
        done.set()

    thread = threading.Thread(target=status)
    thread.start()
    try:
        while not done.is_set():
            worker._receive(50)  # the idle loop's call
    finally:
        thread.join(10)
        received = 0
        while router.poll(100):
            router.recv_multipart()
            received += 1
        dealer.close(0)
        router.close(0)
    assert received == 20
    assert lock.loop_takes_while_waiting == 0, (lock.loop_takes_while_waiting, waits)
    assert max(waits) < 0.2, waits
