"""`kvserve serve`: run memsvc, N runners and the gRPC frontend as supervised children.

Each child is ``python -m kvserve.cli <role> ...`` (so its command line names its
role), shares one runtime dir, and gets its own sd_notify socket from this supervisor so
that READY=1 tells us it is up (runners count as up once the frontend lists them live).
A child that dies is restarted (runners and memsvc re-attach by themselves); one that
dies more than ``--max-restarts`` times within ``--restart-window-s`` makes serve give
up and exit 1. SIGINT/SIGTERM stop the frontend first (it drains), then the runners,
then memsvc, remove the sockets, and exit 0.

The whole config (kvserve.config.serve: serve's flags, the [serve], [memsvc], [runner]
and [frontend] tables, KVSERVE_*) is validated before anything starts. Each child's
command line then carries its config (every setting that differs from the child's
default, plus what serve sets: addresses, runner ids, metrics ports, the runtime dir),
and the child inherits neither $KVSERVE_CONFIG nor the KVSERVE_* variables of its own
settings, so it runs exactly what serve validated.

This module knows process management and the children's flags, nothing about their
internals; it never imports torch (device and dtype "auto" are resolved by the children).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from kvserve import sdnotify
from kvserve.config import CONFIG_ENV, ENV_PREFIX, ConfigError, setting_fields, to_flags
from kvserve.config.serve import CHILDREN, ServeConfig, add_serve_flags, load_serve_config
from kvserve.paths import FRONTEND_SOCKET, MEMSVC_SOCKET, ipc_address, runtime_dir

log = logging.getLogger("kvserve.serve")

POLL_S = 0.1
STOP_TIMEOUT_S = 15.0


@dataclass
class Child:
    """One supervised process."""

    name: str
    role: str
    argv: list[str]
    notify_path: Path
    proc: subprocess.Popen | None = None
    sock: socket.socket | None = None
    ready: bool = False
    deaths: deque[float] = field(default_factory=deque)
    env_drop: frozenset[str] = frozenset()  # variables the child must not inherit


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM if the supervisor dies (Linux prctl)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _share_cores(cfg: ServeConfig) -> dict[str, object]:
    """Several runners with torch's default thread count each would oversubscribe the CPU
    (every runner takes all cores, and OpenMP spins): give each its share instead."""
    if cfg.runners == 1 or cfg.runner.threads:
        return {}
    return {"threads": max(1, (os.cpu_count() or 1) // cfg.runners)}


class Supervisor:
    """Starts, watches, restarts and stops the children of one `kvserve serve`."""

    def __init__(self, cfg: ServeConfig, runtime: Path) -> None:
        self.cfg = cfg
        self.runtime = runtime
        self.stopping = False
        self.memsvc_address = ipc_address(MEMSVC_SOCKET, runtime)
        self.frontend_address = ipc_address(FRONTEND_SOCKET, runtime)
        here = {"runtime_dir": str(runtime)}
        self.children = [self._child("memsvc", cfg.memsvc, here | {
            "address": self.memsvc_address, "metrics_port": cfg.child_metrics_port("memsvc")})]
        for i in range(cfg.runners):
            self.children.append(self._child(f"runner-{i}", cfg.runner, here | _share_cores(cfg) | {
                "memsvc_address": self.memsvc_address, "frontend_address": self.frontend_address,
                "runner_id": f"runner-{i}", "metrics_port": cfg.child_metrics_port("runner", i)}))
        self.children.append(self._child("frontend", cfg.frontend, here | {
            "frontend_address": self.frontend_address, "metrics_port": cfg.child_metrics_port("frontend")}))

    def _child(self, name: str, child_cfg: object, sets: dict[str, object]) -> Child:
        """A child whose command line rebuilds `child_cfg` with what serve `sets` on top (those
        flags always written out); validated here, before anything starts."""
        role = next(r for r, cls in CHILDREN.items() if isinstance(child_cfg, cls))
        try:
            full = dataclasses.replace(child_cfg, **sets)
        except ConfigError as exc:
            raise ConfigError(f"{role} settings: {exc}") from None
        argv = [sys.executable, "-m", "kvserve.cli", role, *to_flags(full, always=sets)]
        # the child must see exactly that config: not the file, nor variables of its settings
        drop = frozenset([CONFIG_ENV, *(ENV_PREFIX + n.upper() for n in setting_fields(type(full)))])
        return Child(name=name, role=role, argv=argv, notify_path=self.runtime / f"notify-{name}.sock",
                     env_drop=drop)

    def by_role(self, role: str) -> list[Child]:
        return [c for c in self.children if c.role == role]

    def spawn(self, child: Child) -> None:
        if child.sock is None:
            child.notify_path.unlink(missing_ok=True)
            child.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            child.sock.bind(str(child.notify_path))
            os.chmod(child.notify_path, 0o600)
            child.sock.setblocking(False)
        env = {k: v for k, v in os.environ.items() if k not in child.env_drop}
        env |= {"NOTIFY_SOCKET": str(child.notify_path), "KVSERVE_RUNTIME_DIR": str(self.runtime)}
        env.pop("WATCHDOG_USEC", None)
        env.pop("WATCHDOG_PID", None)
        child.ready = False
        child.proc = subprocess.Popen(child.argv, env=env, start_new_session=True,
                                      preexec_fn=_die_with_parent)
        log.info("started %s (pid %d)", child.name, child.proc.pid)

    def poll_notify(self) -> None:
        for child in self.children:
            while child.sock is not None:
                try:
                    data = child.sock.recv(4096)
                except BlockingIOError:
                    break
                if b"READY=1" in data.split(b"\n") and not child.ready:
                    child.ready = True
                    log.info("%s is ready", child.name)

    def poll_runners_live(self) -> None:
        """Runners count as ready once the frontend lists them as live."""
        frontend = self.by_role("frontend")[0]
        if not frontend.ready or all(c.ready for c in self.by_role("runner")):
            return
        live = set(_live_runner_ids(self.cfg.frontend.host, self.cfg.frontend.port))
        for c in self.by_role("runner"):
            if not c.ready and c.name in live:
                c.ready = True
                log.info("%s is ready", c.name)

    def reap(self) -> bool:
        """Restart children that died; False when one died too often (give up)."""
        now = time.monotonic()
        for child in self.children:
            if child.proc is None or child.proc.poll() is None:
                continue
            log.warning("%s (pid %d) exited with status %s", child.name, child.proc.pid, child.proc.returncode)
            child.deaths.append(now)
            while child.deaths and now - child.deaths[0] > self.cfg.restart_window_s:
                child.deaths.popleft()
            if len(child.deaths) > self.cfg.max_restarts:
                log.error("%s died %d times within %.0f s; giving up", child.name,
                          len(child.deaths), self.cfg.restart_window_s)
                return False
            self.spawn(child)
        return True

    def all_ready(self) -> bool:
        return all(c.ready for c in self.children)

    def stop_all(self) -> None:
        """Frontend first (it drains), then runners, then memsvc; SIGKILL what lingers."""
        order = [("frontend", self.cfg.frontend.drain_timeout_s + 5.0), ("runner", STOP_TIMEOUT_S),
                 ("memsvc", STOP_TIMEOUT_S)]
        for role, timeout in order:
            group = [c for c in self.by_role(role) if c.proc is not None]
            for c in group:
                if c.proc.poll() is None:
                    c.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for c in group:
                try:
                    c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in %.0f s; killing it", c.name, timeout)
                    c.proc.kill()
                    c.proc.wait()
        for c in self.children:
            if c.sock is not None:
                c.sock.close()
                c.sock = None
            c.notify_path.unlink(missing_ok=True)
        for name in (FRONTEND_SOCKET, MEMSVC_SOCKET):
            (self.runtime / name).unlink(missing_ok=True)


def _live_runner_ids(host: str, port: int) -> list[str]:
    import grpc

    from kvserve.v1 import generator_pb2 as pb
    from kvserve.v1 import generator_pb2_grpc as pb_grpc

    try:
        with grpc.insecure_channel(f"{host}:{port}") as channel:
            report = pb_grpc.GeneratorStub(channel).GetLoad(pb.GetLoadRequest(), timeout=1.0)
        return [r.runner_id for r in report.runners if r.live]
    except grpc.RpcError:
        return []


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None, help=(
        "TOML file: its [serve] table, and the [memsvc], [runner] and [frontend] tables handed "
        "to the children; serve's flags and [serve] keys win over those (default: $KVSERVE_CONFIG)"))
    add_serve_flags(parser)
    return parser


def run(sup: Supervisor) -> int:
    """Run the service until SIGINT/SIGTERM (0) or until it cannot be kept up (1)."""
    cfg = sup.cfg
    stop_signals: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, _f: stop_signals.append(s))
    status = 0
    started = time.monotonic()
    announced = False
    watchdog = sdnotify.watchdog_interval_s()
    last_watchdog = 0.0
    try:
        for child in sup.children:
            if child.role != "runner":
                sup.spawn(child)
        while not stop_signals:
            sup.poll_notify()
            if sup.by_role("memsvc")[0].ready and any(c.proc is None for c in sup.by_role("runner")):
                for c in sup.by_role("runner"):
                    sup.spawn(c)
            sup.poll_runners_live()
            if not sup.reap():
                status = 1
                break
            if not announced and sup.all_ready():
                announced = True
                http = (f", OpenAI HTTP API on http{'s' if cfg.frontend.tls_cert else ''}://"
                        f"{cfg.frontend.host}:{cfg.frontend.http_port}/v1" if cfg.frontend.http_port else "")
                print(f"kvserve serving on {cfg.frontend.host}:{cfg.frontend.port} ({cfg.runners} runner(s)){http}",
                      flush=True)
                sdnotify.notify("READY=1")
            if not announced and time.monotonic() - started > cfg.ready_timeout_s:
                waiting = [c.name for c in sup.children if not c.ready]
                log.error("not ready after %.0f s: %s", cfg.ready_timeout_s, ", ".join(waiting))
                status = 1
                break
            if watchdog and time.monotonic() - last_watchdog > watchdog:
                sdnotify.notify("WATCHDOG=1")
                last_watchdog = time.monotonic()
            time.sleep(POLL_S)
    finally:
        sdnotify.notify("STOPPING=1")
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sup.stop_all()
    log.info("stopped (status %d)", status)
    return status


def main(argv: list[str] | None = None) -> int:
    """Entry point of `kvserve serve`; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s serve %(levelname)s %(message)s")
    try:
        cfg = load_serve_config(toml_path=args.config, flags=vars(args))
        sup = Supervisor(cfg, runtime_dir(cfg.runtime_dir or None))
    except (ConfigError, PermissionError) as exc:
        print(f"kvserve serve: {exc}", file=sys.stderr)
        return 2
    return run(sup)


if __name__ == "__main__":
    sys.exit(main())
