"""Helpers of the fault tests: the process-level pieces come from `kvserve.tools.servectl`
(a real `kvserve serve`, its children, health, metrics, stats, RSS); here are the streams
consumed in threads and the request builders."""

from __future__ import annotations

import threading
import time

import grpc

from kvserve.tools.servectl import (  # noqa: F401  (re-exported for the tests)
    ROLES,
    SERVING,
    LeftBehind,
    Service,
    children_of,
    free_block,
    memfd_mappings,
    rss_kib,
    start_serve,
    stop_process,
    stop_serve,
)
from kvserve.v1 import generator_pb2 as pb
from kvserve.v1 import generator_pb2_grpc as pb_grpc

DEFAULT_PATH = ("--quantization", "int4")
"""The serve flags that put the fault tests' tiny model (a float HF directory) on the default
model's path: its projections as 4-bit codes on the native kernels; `start_serve(...,
dtype=None)` leaves the dtype to serve (bf16 where the CPU has native bf16)."""


class Stream:
    """One Generate call consumed in a thread: tokens, first-token event, final status."""

    def __init__(self, stub: pb_grpc.GeneratorStub, req: pb.GenerateRequest, timeout: float = 60.0,
                 metadata: tuple = ()) -> None:
        self.call = stub.Generate(req, timeout=timeout, metadata=metadata)
        self.tokens: list[int] = []
        self.text = ""
        self.last: pb.GenerateResponse | None = None
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.first = threading.Event()
        self.first_at = 0.0  # time.monotonic() of the first token (0.0: none yet)
        self.ended_at = 0.0
        self._thread = threading.Thread(target=self._consume, daemon=True)
        self._thread.start()

    def _consume(self) -> None:
        try:
            for msg in self.call:
                self.tokens.extend(msg.token_ids)
                self.text += msg.text
                self.last = msg
                if self.tokens and not self.first_at:
                    self.first_at = time.monotonic()
                    self.first.set()
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            self.code, self.details = exc.code(), exc.details() or ""
        self.ended_at = time.monotonic()
        self.first.set()

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()


def greedy(text: str, max_new: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=text, sampling=pb.SamplingParams(max_new_tokens=max_new, ignore_eos=True))
