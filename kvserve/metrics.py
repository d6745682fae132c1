"""The metrics HTTP server every process uses, and helpers shared by the metric sets.

Each process defines its own metrics (`kvserve.memsvc.metrics`, `kvserve.runner.metrics`,
`kvserve.frontend.metrics`), each in a `CollectorRegistry` of its own (never the global
default one), so tests and several roles in one process never collide. The names are the
contract that `ops/prometheus` and `ops/grafana` are checked against (tests/ops).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, start_http_server

from kvserve import __version__


def info_labels(labels: dict[str, object]) -> dict[str, str]:
    out = {"version": __version__}
    for key, value in labels.items():
        if not key.isidentifier():
            raise ValueError(f"info label name {key!r} is not a valid identifier")
        out[key] = "" if value is None else str(value)
    return out



class MetricsServer(Protocol):
    """What `serve_metrics` returns: the bound `port` (0 when not serving) and `shutdown()`."""

    port: int

    def shutdown(self) -> None: ...


@dataclass(slots=True)
class _NoServer:
    port: int = 0

    def shutdown(self) -> None:
        """Nothing to stop."""


@dataclass(slots=True, eq=False)
class _HttpServer:
    server: object
    thread: threading.Thread
    port: int

    def shutdown(self) -> None:
        """Stop serving, close the listening socket and join the thread."""
        self.server.shutdown()  # type: ignore[attr-defined]
        self.server.server_close()  # type: ignore[attr-defined]
        self.thread.join(timeout=5.0)


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "127.0.0.1") -> MetricsServer:
    """Serve `registry` at http://host:port/metrics from a daemon thread.

    `port == 0` means metrics are off: nothing listens and a no-op object is returned.
    Raises ValueError for a port outside 0..65535 and OSError when it cannot bind.
    """
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ValueError(f"metrics port must be an integer in 0..65535 (0 = off), got {port!r}")
    if port == 0:
        return _NoServer()
    server, thread = start_http_server(port, addr=host, registry=registry)
    return _HttpServer(server=server, thread=thread, port=server.server_address[1])


_SUFFIXES: dict[str, tuple[str, ...]] = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "gauge": ("",),
}


def exported_names(registry: CollectorRegistry) -> set[str]:
    """Every series name `registry` can export (`..._bucket`, `..._total`, `..._info`, ...).

    Derived from the metric families, so labelled metrics that have no child yet count too.
    """
    names: set[str] = set()
    for metric in registry.collect():
        names.update(metric.name + sfx for sfx in _SUFFIXES.get(metric.type, ("",)))
        names.update(s.name for s in metric.samples)
    return names
