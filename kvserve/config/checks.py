"""Range and address checks shared by the process configs' ``__post_init__``.

Each raises `ConfigError` naming the flag (``--metrics-port``, ``--address``, ...). Knows
nothing about sockets: an address is only text here.
"""

from __future__ import annotations

import ipaddress

from kvserve.config import ConfigError, flag_name


def check_port(name: str, value: int, *, allow_zero: bool) -> None:
    """`value` is a TCP port (0 allowed when it means "off" or "pick one")."""
    low = 0 if allow_zero else 1
    if not low <= value <= 65535:
        raise ConfigError(f"{flag_name(name)}: {value} is not a port in {low}..65535")


def check_positive(cfg: object, *names: str) -> None:
    """Each named attribute of `cfg` is > 0."""
    for name in names:
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{flag_name(name)}: must be > 0, got {getattr(cfg, name)}")


def check_at_least(cfg: object, low: int, *names: str) -> None:
    """Each named attribute of `cfg` is >= `low` (None counts as not set)."""
    for name in names:
        value = getattr(cfg, name)
        if value is not None and value < low:
            raise ConfigError(f"{flag_name(name)}: must be >= {low}, got {value}")


def is_loopback(host: str) -> bool:
    """True for localhost and loopback IP literals (names other than localhost are not)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def tcp_host(address: str) -> str:
    """The host of tcp://HOST:PORT (brackets of an IPv6 literal removed)."""
    return address[len("tcp://"):].rpartition(":")[0].strip("[]")


def is_loopback_tcp(address: str) -> bool:
    return address.startswith("tcp://") and is_loopback(tcp_host(address))


def check_address(address: str, *, name: str, allow_remote: bool) -> None:
    """Accept ipc://PATH and tcp://HOST:PORT; tcp only on loopback unless `allow_remote`
    (the ZMQ links have no authentication). `name` is the field, for the message."""
    flag = flag_name(name)
    if address.startswith("ipc://"):
        if len(address) <= len("ipc://"):
            raise ConfigError(f"{flag}: ipc:// needs a path")
        return
    if not address.startswith("tcp://"):
        raise ConfigError(f"{flag}: {address!r} must start with ipc:// or tcp://")
    host, port = tcp_host(address), address.rpartition(":")[2]
    if not port.isdigit() or not host:
        raise ConfigError(f"{flag}: {address!r} is not tcp://HOST:PORT")
    if not allow_remote and not is_loopback(host):
        raise ConfigError(f"{flag}: {host} is not a loopback address (use --allow-remote)")


def check_kv_events(live: str, replay: str, block_size: int, *, allow_remote: bool) -> None:
    """The KV-event settings (kv_events_endpoint, kv_events_replay_endpoint,
    kv_event_block_size): both endpoints or neither, distinct tcp://HOST:PORT with a concrete
    host (routers refuse * and 0.0.0.0), loopback unless `allow_remote`."""
    if bool(live) != bool(replay):
        raise ConfigError("--kv-events-endpoint and --kv-events-replay-endpoint go together")
    if block_size < 1:
        raise ConfigError(f"--kv-event-block-size: must be >= 1, got {block_size}")
    if not live:
        return
    if live == replay:
        raise ConfigError(f"--kv-events-replay-endpoint: {replay} is also --kv-events-endpoint")
    for name, address in (("kv_events_endpoint", live), ("kv_events_replay_endpoint", replay)):
        if not address.startswith("tcp://"):
            raise ConfigError(f"{flag_name(name)}: {address!r} must be tcp://HOST:PORT (routers connect over TCP)")
        if tcp_host(address) in ("*", "0.0.0.0", "::"):
            raise ConfigError(f"{flag_name(name)}: {address!r} needs a concrete host (routers refuse * and "
                              "0.0.0.0)")
        check_address(address, name=name, allow_remote=allow_remote)
