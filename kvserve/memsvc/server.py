"""`kvserve memsvc`: the ZMQ ROUTER loop around `MemsvcService`, metrics port, signals.

Binds ``ipc://<runtime_dir>/memsvc.sock`` (socket file 0600 in a 0700 directory) unless
``--address`` says otherwise; answers every frame; reaps dead leases and checks the pool's
invariants while idle; speaks sd_notify (READY, WATCHDOG, STOPPING). SIGTERM/SIGINT stop
it cleanly (socket file removed, exit 0).

This module knows nothing about pool internals beyond what `MemsvcService` offers.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import zmq

from kvserve import sdnotify
from kvserve.config import ConfigError, config_from_args, parse_size, process_parser
from kvserve.config.curve import ServerKeys, apply_server, require_curve, server_keys
from kvserve.config.devices import resolve_device, resolve_dtype
from kvserve.config.memsvc import MemsvcConfig
from kvserve.memsvc.kv_events import EventPublisher
from kvserve.memsvc.shape import resolve_shape
from kvserve.messages.runner_memsvc import REQUESTS, Stats
from kvserve.metrics import serve_metrics
from kvserve.paths import MEMSVC_SOCKET, bind_private, ipc_address
from kvserve.wire import MAX_FRAME_BYTES

if TYPE_CHECKING:
    from kvserve.memsvc.service import MemsvcService
    from kvserve.memsvc.tiers import TierSettings

log = logging.getLogger("kvserve.memsvc")

POLL_MS = 100
REAP_INTERVAL_S = 0.2
IDLE_AFTER_S = 0.2


def _claim_ipc_path(ctx: zmq.Context, address: str) -> Path:
    """Refuse a socket path another live memsvc serves; remove a stale one."""
    path = Path(address[len("ipc://"):])
    if path.exists():
        probe = ctx.socket(zmq.DEALER)
        probe.linger = 0
        probe.connect(address)
        probe.send(REQUESTS.encode(Stats()))
        alive = probe.poll(300) != 0
        probe.close()
        if alive:
            raise OSError(f"another memsvc is serving at {address}")
        path.unlink()
    return path


class MemsvcServer:
    """One bound ROUTER socket serving one `MemsvcService` until `stop()`."""

    def __init__(self, service: MemsvcService, address: str, *, integrity_interval_s: float = 1.0,
                 curve: ServerKeys | None = None, events: tuple[str, str] | None = None,
                 events_curve: bool = False) -> None:
        self.service = service
        self.address = address
        self.integrity_interval_s = integrity_interval_s
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        if curve is not None:  # only runners whose public key is listed get an answer
            apply_server(self.sock, self.ctx, curve, name="memsvc")
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)  # larger: refused before it is read
        if address.startswith("ipc://"):
            _claim_ipc_path(self.ctx, address)
        self._ipc_path = bind_private(self.sock, address)
        self.publisher: EventPublisher | None = None
        if events is not None:  # KV-cache events for routers: (live endpoint, replay endpoint)
            try:
                self.publisher = EventPublisher(self.ctx, *events, curve=curve if events_curve else None)
            except zmq.ZMQError:
                self.sock.close(0)
                self.ctx.term()
                raise
            self._publish({})  # AllBlocksCleared goes out as seq 0 before memsvc is ready
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        if self.publisher is not None:
            self._poller.register(self.publisher.replay, zmq.POLLIN)
        self._running = True

    def stop(self, *_: object) -> None:
        self._running = False

    def serve(self) -> None:
        """Answer requests until stop(); reap leases, check integrity, feed the watchdog."""
        svc, sock = self.service, self.sock
        watchdog = sdnotify.watchdog_interval_s()
        now = time.monotonic()
        last_msg = last_reap = last_check = last_dog = now
        while self._running:
            ready = dict(self._poller.poll(POLL_MS))
            if sock in ready:
                while True:
                    try:
                        parts = sock.recv_multipart(zmq.NOBLOCK, copy=True)
                    except zmq.Again:
                        break
                    ident = parts[0]
                    if len(parts) != 2:
                        reply = svc.bad(f"bad message: expected 1 frame per message, got {len(parts) - 1}")
                    else:
                        reply = svc.handle(parts[1])
                    sock.send_multipart([ident, reply])
                last_msg = time.monotonic()
            if self.publisher is not None:
                svc.poll_tiers()
                self._publish(ready)
            now = time.monotonic()
            if now - last_reap >= REAP_INTERVAL_S:
                svc.reap(now)
                last_reap = now
            if now - last_msg >= IDLE_AFTER_S and now - last_check >= self.integrity_interval_s:
                svc.check()
                last_check = now
            if watchdog is not None and now - last_dog >= watchdog:
                sdnotify.notify("WATCHDOG=1")
                last_dog = now

    def _publish(self, ready: dict) -> None:
        """Send the KV events the handled messages caused (never blocks) and answer replays;
        the metrics follow the counters of `BlockEvents` and `EventPublisher`."""
        pub, ev, m = self.publisher, self.service.events, self.service.metrics
        assert pub is not None and ev is not None
        replays = pub.replay in ready
        if not ev.pending and not replays:
            return
        def counts() -> tuple[int, ...]:
            return pub.sent, pub.dropped, ev.stored_blocks, ev.removed_blocks, pub.bad_replays

        before = counts()
        pub.publish(ev.take())
        if replays:
            pub.serve_replays()
        sent, dropped, stored, removed, bad = (now - then for now, then in zip(counts(), before, strict=True))
        m.kv_event_messages.labels(outcome="sent").inc(sent)
        m.kv_event_messages.labels(outcome="dropped").inc(dropped)
        m.kv_event_blocks.labels(type="BlockStored").inc(stored)
        m.kv_event_blocks.labels(type="BlockRemoved").inc(removed)
        m.bad_messages.labels(reason="malformed").inc(bad)

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        self.sock.close(0)
        self.ctx.term()
        if self._ipc_path is not None:
            self._ipc_path.unlink(missing_ok=True)
        self.service.close()


def tier_settings(cfg: MemsvcConfig) -> TierSettings | None:
    """The host and disk tiers `cfg` asks for (None: neither), with the model's fingerprint."""
    from kvserve.memsvc.tiers import TierSettings, model_fingerprint
    from kvserve.model.files import resolve_model

    host, disk = parse_size(cfg.host_cache_bytes), parse_size(cfg.disk_cache_bytes)
    if host == 0 and not cfg.disk_cache_dir:
        return None
    model = b"explicit layout" if cfg.n_layers is not None else model_fingerprint(Path(resolve_model(cfg.model)))
    return TierSettings(host_bytes=host, disk_dir=cfg.disk_cache_dir, disk_bytes=disk, model=model,
                        block_size=cfg.kv_event_block_size)


def build_parser() -> argparse.ArgumentParser:
    return process_parser("kvserve memsvc", "Run the KV memory service.", MemsvcConfig, "memsvc")


def main(argv: list[str] | None = None) -> int:
    """Entry point of `kvserve memsvc`."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        cfg = config_from_args(MemsvcConfig, args, section="memsvc", toml_path=args.config)
        device = resolve_device(cfg.device)  # "auto": the same resolution as the runners'
        cfg = dataclasses.replace(cfg, device=device, dtype=resolve_dtype(cfg.dtype, device))
        shape = resolve_shape(cfg)
        address = cfg.address or ipc_address(MEMSVC_SOCKET, cfg.runtime_dir)
        curve = None
        if require_curve(address, "address", ("curve_secret_key_file", cfg.curve_secret_key_file),
                         ("curve_public_keys_dir", cfg.curve_public_keys_dir)):
            curve = server_keys(cfg.curve_secret_key_file, cfg.curve_public_keys_dir,
                                secret_field="curve_secret_key_file", dir_field="curve_public_keys_dir")
    except (ConfigError, PermissionError) as exc:
        print(f"kvserve memsvc: error: {exc}", file=sys.stderr)
        return 2
    from kvserve.memsvc.service import MemsvcService  # torch: only once the config is valid
    from kvserve.memsvc.tiers import TierError

    try:
        tiers = tier_settings(cfg)
    except (ConfigError, OSError, ValueError) as exc:  # a model file that cannot be read
        print(f"kvserve memsvc: error: {exc}", file=sys.stderr)
        return 2
    try:
        service = MemsvcService(shape, policy=cfg.policy, grow_chunk=cfg.grow_chunk, device=cfg.device,
                                lease_timeout_s=cfg.lease_timeout_s, lease_grace_s=cfg.lease_grace_s,
                                reclaim_quarantine_s=cfg.reclaim_quarantine_s,
                                kv_event_block_size=cfg.kv_event_block_size if cfg.kv_events_endpoint else 0,
                                tiers=tiers)
    except TierError as exc:
        print(f"kvserve memsvc: error: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"kvserve memsvc: error: cannot allocate the pool: {exc}", file=sys.stderr)
        return 1
    try:
        events = (cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint) if cfg.kv_events_endpoint else None
        # CURVE on the event sockets when not loopback (the config refused that without keys
        # unless --kv-events-plaintext)
        server = MemsvcServer(service, address, integrity_interval_s=cfg.integrity_interval_s, curve=curve,
                              events=events, events_curve=cfg.kv_events_remote and not cfg.kv_events_plaintext)
    except (zmq.ZMQError, OSError) as exc:
        service.close()
        where = address if events is None else f"{address}, {events[0]} or {events[1]}"
        print(f"kvserve memsvc: error: cannot bind {where}: {exc}", file=sys.stderr)
        return 1
    try:
        http = serve_metrics(service.metrics.registry, cfg.metrics_port, cfg.metrics_host)
    except OSError as exc:
        server.close()
        print(f"kvserve memsvc: error: metrics port {cfg.metrics_port}: {exc}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, server.stop)
    signal.signal(signal.SIGINT, server.stop)
    print(f"memsvc ready address={address} curve={'on' if curve else 'off'} slots={shape.size} "
          f"page_size={shape.page_size} policy={cfg.policy} device={cfg.device} metrics_port={cfg.metrics_port}"
          f"{f' kv_events={cfg.kv_events_endpoint}' if cfg.kv_events_endpoint else ''}", flush=True)
    sdnotify.notify("READY=1")
    try:
        server.serve()
    finally:
        sdnotify.notify("STOPPING=1")
        server.close()
        http.shutdown()
    log.info("memsvc stopped")
    return 0
