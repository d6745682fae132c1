"""`kvserve runner`: one runner worker process (model + scheduler between memsvc and the frontend).

`main(argv)` reads a frozen `RunnerConfig`, builds a `Worker` (`worker.py`), sets it up
(load the model, attach to memsvc, connect to the frontend and say `Hello`) and runs its
loop: frames from the frontend in, one `Scheduler.step()` at a time, one `TokenBatch` out
per step. A background thread (`link.py`) sends `RunnerStatus` every `STATUS_INTERVAL_S`
even while a long forward runs; if it dies, the process exits 1. When memsvc stops
answering or the lease runs out, in-flight requests fail with finish_reason "error" and
the worker re-attaches. SIGTERM/SIGINT stop the loop; exit 0. Configuration, model and
memsvc errors found before the loop exit 2.

Test hooks (`faults.py`): `KVSERVE_FAULT_CRASH_ON_TOKEN=<id>` makes the runner exit 70 on
a prompt holding that token id, `KVSERVE_FAULT_LAYER_DELAY_S=<seconds>` sleeps before each
layer's lease check.

This module only parses the command line, installs the signal handlers and maps errors to
exit statuses; the scheduling lives in `scheduler.py`, the wiring of processes in `worker.py`.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from kvserve import sdnotify
from kvserve.config import ConfigError, config_from_args, process_parser
from kvserve.config.runner import RunnerConfig
from kvserve.runner.worker import Worker


def build_parser() -> argparse.ArgumentParser:
    return process_parser("kvserve runner", "Run one runner worker.", RunnerConfig, "runner")


def main(argv: list[str] | None = None) -> int:
    """Entry point of `kvserve runner`."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        cfg = config_from_args(RunnerConfig, args, section="runner", toml_path=args.config)
        worker = Worker(cfg)
    except (ConfigError, PermissionError) as exc:
        print(f"kvserve runner: error: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, worker.stop)
    signal.signal(signal.SIGINT, worker.stop)
    from kvserve.memsvc.client import MemsvcError
    from kvserve.model.config import ModelLoadError
    from kvserve.model.files import ModelFileError

    try:
        try:
            if not worker.setup():
                sdnotify.notify("STOPPING=1")
                return 0
        except (ModelLoadError, ModelFileError) as exc:
            print(f"kvserve runner: error: model: {exc}", file=sys.stderr)
            return 2
        except MemsvcError as exc:
            print(f"kvserve runner: error: memsvc: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:
            print(f"kvserve runner: error: {exc}", file=sys.stderr)
            return 1
        return worker.run()
    finally:
        worker.close()


if __name__ == "__main__":
    sys.exit(main())
