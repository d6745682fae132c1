"""`MemClient`: how a runner talks to memsvc (attach, step, heartbeats, detach).

One DEALER socket for requests from the caller's thread, and a second DEALER owned by a
heartbeat thread that sends `Heartbeat` every `HEARTBEAT_INTERVAL_S` while attached, so
a long forward pass never loses the lease. After `attach` the shared buffers are mapped:
`k_buffer`, `v_buffer` (writable) and `req_to_token` (runners must only read it).

Lease fencing: every answered Attach, Step or Heartbeat renews the lease until the time it
was *sent* plus the lease's TTL, on this process's monotonic clock; `fence()` raises
`LeaseExpired` past that time, and the runner calls it before every layer's KV write. A
runner that stalls (SIGSTOP, swap, a long GC) therefore writes nothing once memsvc may
have reclaimed its slots (docs/interfaces.md, "Lease fencing").

This module knows nothing about the runner's scheduler or the pool's internals.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import torch
import zmq

from kvserve.config.curve import ClientKeys, apply_client
from kvserve.memsvc.sharing import open_buffer
from kvserve.messages.runner_memsvc import (
    PROTOCOL_VERSION,
    REPLIES,
    REQUESTS,
    Admit,
    Attach,
    AttachReply,
    Commit,
    Detach,
    ErrorReply,
    Grow,
    Heartbeat,
    Layout,
    Release,
    Stats,
    StatsReply,
    Step,
    StepReply,
)
from kvserve.procs import pid_alive
from kvserve.wire import MAX_FRAME_BYTES, WireError

HEARTBEAT_INTERVAL_S = 0.3
REPLY_POLL_S = 0.05

__all__ = [
    "Admit", "Commit", "Grow", "LeaseExpired", "Layout", "MemClient", "MemsvcError", "MemsvcUnavailable",
    "Release", "StepReply",
]


class MemsvcError(RuntimeError):
    """memsvc refused a request (the message names why)."""


class MemsvcUnavailable(MemsvcError):
    """memsvc did not answer in time: fail in-flight work and re-attach."""


class LeaseExpired(MemsvcError):
    """The lease may have been reclaimed: write no KV, fail in-flight work, re-attach."""


class MemClient:
    """A runner's connection to one memsvc."""

    def __init__(self, address: str, name: str = "runner", timeout_s: float = 5.0,
                 curve: ClientKeys | None = None) -> None:
        """`curve`: this runner's key pair and memsvc's public key (kvserve.config.curve);
        needed for a tcp:// memsvc, which answers only keys it lists."""
        self.address = address
        self.curve = curve
        self.name = name
        self.timeout_s = timeout_s
        self.layout: Layout | None = None
        self.lease: int | None = None
        self.k_buffer: torch.Tensor | None = None
        self.v_buffer: torch.Tensor | None = None
        self.req_to_token: torch.Tensor | None = None
        self.lease_lost = False
        self.lease_ttl_s = 0.0
        self.valid_until = 0.0  # time.monotonic() past which the lease may be gone
        self._usage = 0.0
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None

    # ---- plumbing --------------------------------------------------------------
    def _socket(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.linger = 0
        if self.curve is not None:
            apply_client(sock, self.curve)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        sock.connect(self.address)
        return sock

    def _request(self, msg: object, sock: zmq.Socket | None = None) -> object:
        own = sock is None
        if own:
            if self._sock is None:
                self._sock = self._socket()
            sock = self._sock
        sent = time.monotonic()
        sock.send(REQUESTS.encode(msg))
        frame = self._reply(sock, sent + self.timeout_s, watch=own and not isinstance(msg, Attach))
        if frame is None:
            if own:  # a late reply must not be read as the answer to the next request
                self._sock.close(0)
                self._sock = None
            gone = " (its process ended)" if own and self.lease_lost else ""
            raise MemsvcUnavailable(f"memsvc at {self.address} did not answer within "
                                    f"{time.monotonic() - sent:.1f} s{gone}")
        try:
            reply = REPLIES.decode(frame)
        except WireError as exc:
            raise MemsvcError(f"undecodable reply from memsvc: {exc}") from None
        if isinstance(reply, ErrorReply):
            raise MemsvcError(reply.error)
        if isinstance(msg, Step | Heartbeat) and self.lease == msg.lease:
            # memsvc received it no earlier than `sent`: the lease lives at least until then + TTL
            self.valid_until = max(self.valid_until, sent + self.lease_ttl_s)
        elif isinstance(reply, AttachReply):
            self.valid_until = sent + reply.lease_ttl_s
        return reply

    def _reply(self, sock: zmq.Socket, deadline: float, *, watch: bool) -> bytes | None:
        """The reply frame, or None at the deadline or, when `watch`, as soon as the
        heartbeat thread found the lease lost (memsvc's process gone): a runner need not wait
        out the whole timeout for a memsvc that is known to be dead."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or (watch and self.lease_lost):
                return None
            if sock.poll(int(min(left, REPLY_POLL_S) * 1000) + 1):
                return sock.recv()

    # ---- public API -------------------------------------------------------------
    def attach(self, *, n_layers: int, n_kv_heads: int, head_dim: int, dtype: str = "float32") -> Layout:
        """Start a lease, check the layout, map the shared buffers; returns the pool's Layout."""
        if self.lease is not None:
            self.detach()
        reply = self._request(Attach(name=self.name, pid=os.getpid(), host=socket.gethostname(),
                                     n_layers=n_layers, n_kv_heads=n_kv_heads, head_dim=head_dim,
                                     dtype=dtype, protocol=PROTOCOL_VERSION))
        assert isinstance(reply, AttachReply)
        try:
            tensors = {h.name: open_buffer(h) for h in reply.buffers}
        except (OSError, ValueError) as exc:
            raise MemsvcError(f"attach: cannot map memsvc buffers: {exc}") from None
        self.k_buffer = tensors["k_buffer"]
        self.v_buffer = tensors["v_buffer"]
        self.req_to_token = tensors["req_to_token"]
        if reply.lease_ttl_s <= 0:
            raise MemsvcError("attach: memsvc gave a lease without a TTL; cannot fence KV writes")
        self.layout, self.lease, self._usage = reply.layout, reply.lease, reply.kv_usage
        self.lease_ttl_s = reply.lease_ttl_s
        self.lease_lost = False
        self._hb_stop.clear()
        self._hb_thread = threading.Thread(target=self._heartbeat_loop,
                                           args=(reply.lease, reply.memsvc_pid),
                                           name=f"memsvc-heartbeat-{self.name}", daemon=True)
        self._hb_thread.start()
        return reply.layout

    def step(self, admit: list[Admit] | None = None, grow: list[Grow] | None = None,
             commit: list[Commit] | None = None, release: list[Release] | None = None) -> StepReply:
        """One round trip carrying the whole batch's needs (processed release, commit, grow, admit)."""
        if self.lease is None:
            raise MemsvcError("step: not attached")
        reply = self._request(Step(lease=self.lease, admit=admit or [], grow=grow or [],
                                   commit=commit or [], release=release or []))
        assert isinstance(reply, StepReply)
        self._usage = reply.kv_usage
        return reply

    def fence(self, layer: int = -1) -> None:
        """Raise `LeaseExpired` unless the lease is certainly still ours (call right before
        writing KV; `layer` only names the write in the error)."""
        where = f" before layer {layer}'s KV write" if layer >= 0 else ""
        if self.lease is None or self.lease_lost:
            raise LeaseExpired(f"KV write refused{where}: not attached to memsvc")
        late = time.monotonic() - self.valid_until
        if late >= 0:
            self.lease_lost = True
            raise LeaseExpired(f"KV write refused{where}: the lease ran out {late:.2f} s ago "
                               f"(no renewal answered within its {self.lease_ttl_s:g} s TTL)")

    def stats(self) -> StatsReply:
        """A snapshot of the pool (works attached or not)."""
        reply = self._request(Stats())
        assert isinstance(reply, StatsReply)
        return reply

    def kv_usage(self) -> float:
        """Pool usage 0..1 from the last reply (no round trip)."""
        return self._usage

    def detach(self) -> None:
        """End the lease: memsvc frees every row it still holds (nothing is committed)."""
        self._stop_heartbeat()
        lease, self.lease = self.lease, None
        self.k_buffer = self.v_buffer = self.req_to_token = None
        if lease is not None:
            try:
                self._request(Detach(lease=lease))
            except MemsvcError:
                pass  # memsvc gone or lease already reclaimed: nothing left to free

    def close(self) -> None:
        """Detach if attached and close the sockets."""
        if self.lease is not None:
            self.detach()
        self._stop_heartbeat()
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        self._ctx.term()

    # ---- heartbeats -------------------------------------------------------------
    def _stop_heartbeat(self) -> None:
        self._hb_stop.set()
        if self._hb_thread is not None and self._hb_thread is not threading.current_thread():
            self._hb_thread.join(timeout=self.timeout_s + 1)
        self._hb_thread = None

    def _heartbeat_loop(self, lease: int, memsvc_pid: int) -> None:
        sock = self._socket()
        try:
            while not self._hb_stop.wait(HEARTBEAT_INTERVAL_S):
                if not pid_alive(memsvc_pid):  # memsvc died (pid 0: remote, rely on replies)
                    self.lease_lost = True
                    return
                try:
                    reply = self._request(Heartbeat(lease=lease), sock)
                    self._usage = getattr(reply, "kv_usage", self._usage)
                except MemsvcUnavailable:
                    sock.close(0)
                    sock = self._socket()
                except MemsvcError:
                    self.lease_lost = True
                    return
        finally:
            sock.close(0)
