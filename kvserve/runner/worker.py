"""The runner's worker: its state, setup, loop and re-attach (`Worker`).

`setup()` loads the model, attaches to memsvc (retrying with backoff until it answers),
connects a DEALER (identity = runner id) to the frontend's ROUTER and says `Hello`; `run()`
then loops: take `GenerateReq` / `AbortReq` frames, run one `Scheduler.step()` while there
is work, send the step's outputs as one `TokenBatch`. While idle it blocks on the frontend
socket with a short timeout. When memsvc stops answering or the lease runs out
(`MemClient.fence`, checked before every layer's KV write), in-flight requests fail with
finish_reason "error" and the worker re-attaches. A token batch the frontend cannot take
within `SEND_TIMEOUT_S` is not dropped silently: its requests are aborted here and counted
(`kvserve_runner_undelivered_outputs_total`).

The socket's traffic and the status thread are `FrontendLink`'s (`link.py`), the fault hooks
`faults.py`'s; the scheduling itself lives in `scheduler.py`. This module knows nothing of
command lines or signals (`main.py`).
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from typing import Any

import zmq

from kvserve import sdnotify
from kvserve.config import ConfigError
from kvserve.config.curve import ClientKeys, apply_client, client_keys, require_curve
from kvserve.config.devices import resolve_device, resolve_dtype
from kvserve.config.runner import RunnerConfig, resolve_backend
from kvserve.messages.frontend_runner import DOWN, AbortReq, GenerateReq, TokenBatch, TokenOut
from kvserve.paths import FRONTEND_SOCKET, MEMSVC_SOCKET, ipc_address
from kvserve.runner.faults import CRASH_EXIT, CRASH_ON_TOKEN_ENV, LAYER_DELAY_ENV, _layer_delay
from kvserve.runner.heap import release_freed_memory
from kvserve.runner.link import IDLE_POLL_MS, FrontendLink
from kvserve.wire import MAX_FRAME_BYTES, WireError

log = logging.getLogger("kvserve.runner")

ATTACH_BACKOFF_S = (0.1, 2.0)
MEMSVC_TIMEOUT_S = 5.0
ATTACH_TIMEOUT_S = 1.0
SEND_TIMEOUT_S = 1.0


class Worker(FrontendLink):
    """The runner process's state. `setup()` loads and connects, `run()` loops until
    `stop()`; the constructor does no I/O."""

    def __init__(self, cfg: RunnerConfig) -> None:
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.quantization = cfg.quantization  # "auto" is resolved from the model file in setup()
        self.backend_name = resolve_backend(cfg.attention_backend, self.device)
        self.stopping = threading.Event()
        self.lock = threading.Lock()  # guards the frontend socket (status thread + loop)
        # set while the status thread waits for the socket: the idle loop, which takes the
        # lock again right after it lets go, stands aside (an unfair lock can starve the
        # waiter for minutes, as it did on a 16-core VM: the frontend dropped the runner)
        self._aside = threading.Event()
        self.loaded: Any = None
        self.mem: Any = None
        self.sched: Any = None
        self.metrics: Any = None
        self._http: Any = None
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None
        self._status_thread: threading.Thread | None = None
        self._next_attach = 0.0
        self.fatal: BaseException | None = None
        crash = os.environ.get(CRASH_ON_TOKEN_ENV, "")
        self._crash_token = int(crash) if crash.strip().isdigit() else None
        self._layer_delay_s = _layer_delay(os.environ.get(LAYER_DELAY_ENV, ""))  # checked before the load
        self.memsvc_address = cfg.memsvc_address or ipc_address(MEMSVC_SOCKET, cfg.runtime_dir or None)
        self.frontend_address = cfg.frontend_address or ipc_address(FRONTEND_SOCKET, cfg.runtime_dir or None)
        self.memsvc_curve = self._curve_keys(self.memsvc_address, "memsvc_address", "memsvc_public_key_file")
        self.frontend_curve = self._curve_keys(self.frontend_address, "frontend_address",
                                               "frontend_public_key_file")
        if cfg.curve_secret_key_file and not (self.memsvc_curve or self.frontend_curve):
            raise ConfigError("--curve-secret-key-file needs --memsvc-public-key-file or "
                              "--frontend-public-key-file (the server whose key to trust)")

    def _curve_keys(self, address: str, address_field: str, server_field: str) -> ClientKeys | None:
        """The CURVE keys of one link (None: plain; a tcp:// address must have them)."""
        cfg = self.cfg
        server_file = getattr(cfg, server_field)
        # the one key pair serves both links: a link uses CURVE when its server's key is given
        secret = cfg.curve_secret_key_file if server_file else ""
        if not require_curve(address, address_field, ("curve_secret_key_file", secret),
                             (server_field, server_file)):
            return None
        return client_keys(secret, server_file, secret_field="curve_secret_key_file", server_field=server_field)

    # ---- setup -------------------------------------------------------------------------
    def setup(self) -> bool:
        """Load the model, start metrics, attach to memsvc, connect to the frontend.
        Returns False when stopped before memsvc answered."""
        import torch

        from kvserve.kernels import DecodeWorkspace, get_backend
        from kvserve.metrics import serve_metrics
        from kvserve.model.weights import load_model
        from kvserve.runner.grammar import Constrainer
        from kvserve.runner.metrics import RunnerMetrics
        from kvserve.runner.scheduler import Scheduler, SchedulerConfig

        cfg = self.cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        gc.disable()  # a load makes millions of small objects: full collections took 1.5 s of it
        try:
            self.loaded = load_model(cfg.model or None, dtype=getattr(torch, self.dtype), device=self.device,
                                     quantization=cfg.quantization)
        finally:
            gc.enable()
        gc.collect()
        gc.freeze()  # what the load left is kept for good: no later collection walks it again
        self.quantization = self.loaded.quantization
        if cfg.quantization == "auto":
            log.info("quantization auto: %s on %s for this model file", self.quantization, self.device)
        backend = get_backend(self.backend_name)
        if str(self.device).startswith("cpu"):
            from kvserve.kernels import native

            # built now (about a second), not inside the first step while it holds a lease
            log.info("native CPU kernels: %s", "loaded" if native.available()
                     else "not available: the torch ops run")
        self.metrics = RunnerMetrics()
        self._http = serve_metrics(self.metrics.registry, cfg.metrics_port)
        if not self._attach():
            return False
        mc = self.loaded.config
        workspace = None
        if self.backend_name == "triton":
            workspace = DecodeWorkspace.create(
                max_batch=cfg.max_running, num_q_heads=mc.num_heads, head_dim=mc.head_dim,
                dtype=getattr(torch, self.dtype), device=self.device,
            )
        self.sched = Scheduler(
            model=self.loaded.model, mem=self.mem, layout=self.mem.layout, backend=backend,
            eos_token_ids=self.loaded.eos_token_ids, metrics=self.metrics, workspace=workspace,
            fault_layer_delay_s=self._layer_delay_s, constrainer=Constrainer(
                self.loaded.tokenizer.backend_tokenizer.to_str, int(mc.vocab_size), self.loaded.eos_token_ids),
            config=SchedulerConfig(max_running=cfg.max_running, max_batch_tokens=cfg.max_batch_tokens,
                                   chunk_size=cfg.chunk_size, seed=cfg.seed,
                                   batch_invariant=cfg.batch_invariant == "on"),
        )
        release_freed_memory()  # the load's float copies and the freed dense ones
        self.metrics.set_info(
            model=self.loaded.name, device=self.device, dtype=self.dtype, backend=self.backend_name,
            runner_id=cfg.runner_id, policy=self.mem.layout.policy, quantization=self.quantization,
        )
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, cfg.runner_id.encode())
        sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only to a connected frontend, never to a dead one
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        sock.linger = 0
        if self.frontend_curve is not None:
            apply_client(sock, self.frontend_curve)
        sock.connect(self.frontend_address)
        self._sock = sock
        self._hello()
        self._status_thread = threading.Thread(target=self._status_loop, name="runner-status", daemon=True)
        self._status_thread.start()
        return True

    def _attach(self) -> bool:
        """Attach to memsvc, retrying with backoff; False if stopped first.
        A layout mismatch raises MemsvcError (retrying cannot fix it)."""
        delay = ATTACH_BACKOFF_S[0]
        while not self.stopping.is_set():
            if self._attach_once():
                return True
            log.info("memsvc at %s not answering; retrying in %.1f s", self.memsvc_address, delay)
            self.stopping.wait(delay)
            delay = min(delay * 2, ATTACH_BACKOFF_S[1])
        return False

    def _attach_once(self) -> bool:
        """One attach attempt (short timeout); True when attached."""
        from kvserve.memsvc.client import MemClient, MemsvcUnavailable

        mc = self.loaded.config
        client = MemClient(self.memsvc_address, name=self.cfg.runner_id, timeout_s=ATTACH_TIMEOUT_S,
                           curve=self.memsvc_curve)
        try:
            client.attach(n_layers=mc.num_layers, n_kv_heads=mc.num_kv_heads,
                          head_dim=mc.head_dim, dtype=self.dtype)
        except MemsvcUnavailable:
            client.close()
            return False
        except BaseException:
            client.close()
            raise
        client.timeout_s = MEMSVC_TIMEOUT_S
        self.mem = client
        return True

    # ---- frames from the frontend ------------------------------------------------------
    def take_frame(self, frame: bytes) -> None:
        """Decode and take one frame from the frontend; any frame, whatever it holds, is
        taken or counted and dropped (a request that cannot be taken fails), never raised."""
        try:
            msg = DOWN.decode(frame)
        except WireError as exc:
            self.metrics.bad_messages.labels(reason="malformed").inc()
            log.warning("bad frame from the frontend: %s", exc)
            return
        try:
            self._take(msg)
        except Exception as exc:  # noqa: BLE001 - no frame may end the runner
            self.metrics.bad_messages.labels(reason="internal").inc()
            log.exception("taking a %s raised", type(msg).__name__)
            if isinstance(msg, GenerateReq):
                self.sched.fail_unqueued(msg.request_id, f"internal error taking the request: {exc!r}")

    def _take(self, msg: GenerateReq | AbortReq) -> None:
        if isinstance(msg, AbortReq):
            self.sched.abort(msg.request_id)
            return
        if self._crash_token is not None and self._crash_token in msg.token_ids:
            log.critical("%s: token %d in request %s: exiting", CRASH_ON_TOKEN_ENV,
                         self._crash_token, msg.request_id)
            os._exit(CRASH_EXIT)
        self.sched.add(msg)

    # ---- the loop ----------------------------------------------------------------------
    def run(self) -> int:
        """Serve until `stop()`; returns the exit status."""
        from kvserve.memsvc.client import MemsvcError

        log.info("runner %s ready", self.cfg.runner_id)
        print(f"runner {self.cfg.runner_id} ready", flush=True)
        sdnotify.notify("READY=1")
        wd_every = sdnotify.watchdog_interval_s()
        last_wd = 0.0
        busy = False
        while not self.stopping.is_set():
            self._receive(0 if busy else self._idle_ms())
            outs: list[TokenOut] = []
            if self.mem is None or self.mem.lease_lost:
                outs = self._memsvc_lost("memsvc lease lost") if self.mem is not None else []
                self._flush(outs + self.sched.drain_offline())
                self._reattach()
                busy = False
                continue
            if self.sched.has_work():
                try:
                    outs = self.sched.step()
                except MemsvcError as exc:
                    outs = self._memsvc_lost(f"memsvc unavailable: {exc}")
                busy = self.sched.ran_forward
            else:
                busy = False
            self._flush(outs)
            if wd_every is not None and time.monotonic() - last_wd >= wd_every:
                sdnotify.notify("WATCHDOG=1")
                last_wd = time.monotonic()
        sdnotify.notify("STOPPING=1")
        self._flush(self._shutdown_outputs())
        return 0 if self.fatal is None else 1

    def _idle_ms(self) -> int:
        """How long an idle loop waits for the frontend: one poll, or less when a request
        waiting for memsvc's disk tier is due again."""
        retry = self.sched.retry_in(time.monotonic()) if self.sched is not None else None
        return IDLE_POLL_MS if retry is None else max(1, min(IDLE_POLL_MS, int(retry * 1000) + 1))

    def _flush(self, outs: list[TokenOut]) -> None:
        """Send the step's outputs; if the frontend cannot take them in time, abort their
        requests here (counted and logged) rather than let them run on unseen."""
        if not outs or self._send(TokenBatch(runner_id=self.cfg.runner_id, outputs=outs), SEND_TIMEOUT_S):
            return
        going = [o.request_id for o in outs if not o.finish_reason]
        self.metrics.undelivered.inc()
        log.error("the frontend took no token batch for %.1f s: %d outputs undelivered, "
                  "aborting %d request(s)", SEND_TIMEOUT_S, len(outs), len(going))
        for request_id in going:
            self.sched.abort(request_id)

    def _memsvc_lost(self, error: str) -> list[TokenOut]:
        log.warning("%s: failing in-flight requests and re-attaching", error)
        outs = self.sched.fail_running(error)
        old, self.mem = self.mem, None
        threading.Thread(target=old.close, daemon=True).start()  # never wait on a dead memsvc
        return outs

    def _reattach(self) -> None:
        """One attempt at most every `ATTACH_BACKOFF_S[1]` s (the loop keeps serving the
        frontend socket in between)."""
        now = time.monotonic()
        if now < self._next_attach:
            return
        self._next_attach = now + ATTACH_BACKOFF_S[1]
        from kvserve.memsvc.client import MemsvcError

        try:
            attached = self._attach_once()
        except MemsvcError as exc:
            log.error("memsvc refused the re-attach: %s", exc)
            return
        if attached:
            # no new Hello: the frontend reads one as a restarted runner and fails its requests
            self.sched.rebind(self.mem, self.mem.layout)
            log.info("runner %s re-attached to memsvc", self.cfg.runner_id)

    def _shutdown_outputs(self) -> list[TokenOut]:
        if self.sched is None:
            return []
        from kvserve.runner.checks import failed_output

        return self.sched.fail_running("runner shutting down") + [
            failed_output(r.request_id, "runner shutting down") for r in list(self.sched.table)
        ]

    def stop(self, *_: Any) -> None:
        """Ask the loop (and a pending attach) to end; safe from a signal handler."""
        self.stopping.set()

    def close(self) -> None:
        """Release every resource (idempotent)."""
        self.stopping.set()
        if self._status_thread is not None:
            self._status_thread.join(timeout=2.0)
        if self.mem is not None:
            self.mem.close()
            self.mem = None
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        self._ctx.term()
        if self._http is not None:
            self._http.shutdown()
            self._http = None
