"""`kvserve frontend`: the front door (gRPC and OpenAI HTTP) in front of the runner workers.

Wires together the `Dispatcher` (ZMQ ROUTER to the runners), the `RequestPath` both faces
share, the gRPC face (grpc.aio: `GeneratorService`, standard `grpc.health.v1` health,
SERVING only while a runner is live, server reflection), the OpenAI HTTP face (FastAPI under
uvicorn on the same event loop, `--http-port`), optional TLS and bearer-token auth on both,
Prometheus metrics and sd_notify (READY=1 once the port answers and a runner is live,
WATCHDOG=1, STOPPING=1). SIGTERM or SIGINT: health goes NOT_SERVING, new requests are
refused, open streams drain for at most ``--drain-timeout-s``, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import logging
import signal
import socket
import ssl
import stat
import sys
from pathlib import Path

import grpc
import uvicorn
import zmq
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvserve import sdnotify
from kvserve.config import ConfigError, config_from_args, process_parser
from kvserve.config.curve import require_curve, server_keys
from kvserve.config.frontend import FrontendConfig
from kvserve.frontend.dispatch import Dispatcher
from kvserve.frontend.grpc_service import GeneratorService
from kvserve.frontend.http_api import OpenAIFace
from kvserve.frontend.metrics import FrontendMetrics
from kvserve.frontend.requests import RequestPath
from kvserve.frontend.router import Router
from kvserve.metrics import serve_metrics
from kvserve.model.tokenizer import load_frontend_tokenizer
from kvserve.paths import FRONTEND_SOCKET, ipc_address
from kvserve.v1 import generator_pb2 as pb
from kvserve.v1 import generator_pb2_grpc as pb_grpc

log = logging.getLogger("kvserve.frontend")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generator"].full_name
HEALTH_NAMES = ("", SERVICE_NAME)
_OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")

def build_parser() -> argparse.ArgumentParser:
    return process_parser("kvserve frontend", __doc__.split("\n\n")[0], FrontendConfig, "frontend")


class _AuthInterceptor(grpc.aio.ServerInterceptor):
    """Reject calls without ``authorization: Bearer <token>`` (health and reflection stay open)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details):  # type: ignore[override]
        if details.method.startswith(_OPEN_METHODS):
            return await continuation(details)
        got = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(str(got).encode(), self._expected):
            return await continuation(details)
        handler = await continuation(details)

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        if handler is not None and handler.response_streaming:
            async def deny_stream(request, context):
                await deny(request, context)
                yield  # pragma: no cover - unreachable, makes this an async generator
            return grpc.unary_stream_rpc_method_handler(deny_stream)
        return grpc.unary_unary_rpc_method_handler(deny)


def _read_token(path_text: str) -> str:
    """The bearer token from a file only its owner may read or write (ConfigError naming the
    file otherwise)."""
    path = Path(path_text)
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
        token = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--auth-token-file: cannot read {path}: "
                          f"{getattr(exc, 'strerror', None) or exc}") from None
    if mode & 0o077:
        raise ConfigError(f"--auth-token-file: {path} has mode {mode:04o}: group or others may "
                          f"read it; run chmod 600 {path}")
    if not token:
        raise ConfigError(f"--auth-token-file: {path} is empty")
    return token


def _read_pem(path_text: str, field: str) -> bytes:
    """A PEM file's bytes (ConfigError naming the flag and the file when unreadable or not PEM)."""
    flag = "--" + field.replace("_", "-")
    try:
        data = Path(path_text).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot read {path_text}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{flag}: {path_text} is not a PEM file (no -----BEGIN line)")
    return data


def _runner_link_curve(cfg: FrontendConfig, address: str) -> bool:
    """Whether the runners' link uses CURVE (a tcp:// address must)."""
    return require_curve(address, "frontend_address", ("curve_secret_key_file", cfg.curve_secret_key_file),
                         ("curve_public_keys_dir", cfg.curve_public_keys_dir))


def _bind(cfg: FrontendConfig) -> tuple[grpc.aio.Server, int]:
    """Create the server and bind its port first, so that a taken port fails at once."""
    interceptors = []
    if cfg.auth_token_file:
        interceptors.append(_AuthInterceptor(_read_token(cfg.auth_token_file)))
    server = grpc.aio.server(
        interceptors=interceptors,
        maximum_concurrent_rpcs=cfg.max_concurrent_rpcs,  # past it: RESOURCE_EXHAUSTED
        options=[("grpc.max_receive_message_length", cfg.max_message_bytes),
                 ("grpc.max_send_message_length", cfg.max_send_message_bytes),
                 ("grpc.so_reuseport", 0),
                 # Keepalive enforcement: a client may ping every 10 s, also with no call open
                 # (what well-behaved clients configure); a client pinging faster is sent a
                 # GOAWAY after 2 strikes instead of costing us a wakeup per ping.
                 ("grpc.keepalive_permit_without_calls", 1),
                 ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
                 ("grpc.http2.max_ping_strikes", 2),
                 # and our own pings find dead clients that still hold streams
                 ("grpc.keepalive_time_ms", 60_000),
                 ("grpc.keepalive_timeout_ms", 20_000)],
    )
    bind = f"{cfg.host}:{cfg.port}"
    try:
        if cfg.tls_cert:
            pair = (_read_pem(cfg.tls_key, "tls_key"), _read_pem(cfg.tls_cert, "tls_cert"))
            if cfg.tls_client_ca:  # mutual TLS: no certificate signed by this CA, no connection
                creds = grpc.ssl_server_credentials([pair], root_certificates=_read_pem(
                    cfg.tls_client_ca, "tls_client_ca"), require_client_auth=True)
            else:
                creds = grpc.ssl_server_credentials([pair])
            return server, server.add_secure_port(bind, creds)
        return server, server.add_insecure_port(bind)
    except RuntimeError as exc:
        raise OSError(f"cannot listen on {bind}: {exc}") from None


def _bind_http(cfg: FrontendConfig) -> socket.socket | None:
    """The HTTP face's listening socket (None when --http-port is 0), bound before anything
    loads, so that a taken port fails at once."""
    if not cfg.http_port:
        return None
    family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    try:
        return socket.create_server((cfg.host, cfg.http_port), family=family, backlog=2048)
    except OSError as exc:
        raise OSError(f"--http-port: cannot listen on {cfg.host}:{cfg.http_port}: {exc.strerror or exc}") from None


class _HTTPServer(uvicorn.Server):
    """uvicorn on the frontend's event loop; the frontend's own signal handlers stay in charge."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        yield


def _http_server(cfg: FrontendConfig, face: OpenAIFace) -> _HTTPServer:
    tls: dict = {}
    if cfg.tls_cert:
        tls = {"ssl_certfile": cfg.tls_cert, "ssl_keyfile": cfg.tls_key}
        if cfg.tls_client_ca:
            tls |= {"ssl_ca_certs": cfg.tls_client_ca, "ssl_cert_reqs": ssl.CERT_REQUIRED}
    config = uvicorn.Config(face.app, lifespan="off", log_level="warning", access_log=False,
                            timeout_graceful_shutdown=1, timeout_keep_alive=30, **tls)
    return _HTTPServer(config)


async def _serve(cfg: FrontendConfig) -> int:
    server, port = _bind(cfg)
    http_sock = _bind_http(cfg)
    tok = await asyncio.to_thread(load_frontend_tokenizer, cfg.tokenizer, cfg.model)
    metrics = FrontendMetrics()
    metrics.set_info(model=tok.name, tokenizer=cfg.tokenizer or "model")
    metrics_server = serve_metrics(metrics.registry, cfg.metrics_port)
    address = cfg.frontend_address or ipc_address(FRONTEND_SOCKET, cfg.runtime_dir or None)
    curve = server_keys(cfg.curve_secret_key_file, cfg.curve_public_keys_dir, secret_field="curve_secret_key_file",
                        dir_field="curve_public_keys_dir") if _runner_link_curve(cfg, address) else None
    health_servicer = health.aio.HealthServicer()
    live = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_runners(n: int) -> None:
        metrics.runners_live.set(n)
        status = health_pb2.HealthCheckResponse.SERVING if n and not path.draining else \
            health_pb2.HealthCheckResponse.NOT_SERVING
        for name in HEALTH_NAMES:
            loop.create_task(health_servicer.set(name, status))
        live.set() if n else live.clear()

    stop = asyncio.Event()
    fatal: list[BaseException] = []

    def on_fatal(exc: BaseException) -> None:
        fatal.append(exc)
        stop.set()

    dispatcher = Dispatcher(address, Router(timeout_s=cfg.runner_timeout_s), on_runners,
                            lambda reason: metrics.bad_messages.labels(reason=reason).inc(),
                            lambda reason: metrics.dropped_outputs.labels(reason=reason).inc(),
                            on_fatal, curve=curve)
    path = RequestPath(cfg, tok, dispatcher, metrics)
    service = GeneratorService(cfg, path)
    pb_grpc.add_GeneratorServicer_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    for name in HEALTH_NAMES:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    dispatcher.start()
    await server.start()
    http = None
    if http_sock is not None:
        face = OpenAIFace(cfg, path, cfg.served_model_name or tok.name,
                          _read_token(cfg.auth_token_file) if cfg.auth_token_file else "",
                          on_ignored=lambda name: metrics.http_ignored_fields.labels(field=name).inc())
        http = _http_server(cfg, face)
        http_task = asyncio.create_task(http.serve(sockets=[http_sock]))
        http_task.add_done_callback(lambda t: None if stop.is_set() else on_fatal(
            t.exception() or RuntimeError("the HTTP server stopped")))
    print(f"frontend listening on {cfg.host}:{port}, runners connect to {address}", flush=True)
    if http_sock is not None:
        print(f"frontend http on {cfg.host}:{http_sock.getsockname()[1]}", flush=True)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watchdog = asyncio.create_task(_watchdog(dispatcher))
    ready = asyncio.create_task(_ready_when_live(live, port))
    await stop.wait()

    sdnotify.notify("STOPPING=1")
    path.draining = True
    for name in HEALTH_NAMES:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    deadline = loop.time() + cfg.drain_timeout_s
    while path.active and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if path.active:
        log.warning("drain timeout: cancelling %d open stream(s)", path.active)
    if http is not None:
        http.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(http_task, timeout=5)
    await server.stop(grace=0.5)
    for task in (watchdog, ready):
        task.cancel()
    await dispatcher.close()
    metrics_server.shutdown()
    if address.startswith("ipc://"):
        Path(address[len("ipc://"):]).unlink(missing_ok=True)
    if fatal:
        print(f"kvserve frontend: an internal task died: {fatal[0]!r}", file=sys.stderr)
        return 1
    return 0


async def _ready_when_live(live: asyncio.Event, port: int) -> None:
    await live.wait()
    print(f"frontend ready on port {port}", flush=True)
    sdnotify.notify("READY=1")


async def _watchdog(dispatcher: Dispatcher) -> None:
    """Feed systemd's watchdog while the event loop turns and the dispatcher's loops live."""
    interval = sdnotify.watchdog_interval_s()
    if interval is None:
        return
    while True:
        if dispatcher.healthy():
            sdnotify.notify("WATCHDOG=1")
        await asyncio.sleep(interval)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `kvserve frontend`; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s frontend %(levelname)s %(message)s")
    try:
        cfg = config_from_args(FrontendConfig, args, section="frontend", toml_path=args.config)
        return asyncio.run(_serve(cfg))
    except ConfigError as exc:
        print(f"kvserve frontend: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError, zmq.ZMQError) as exc:
        print(f"kvserve frontend: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
