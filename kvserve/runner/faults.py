"""The runner's fault hooks for the fault tests, read from its environment.

With `KVSERVE_FAULT_CRASH_ON_TOKEN=<id>` the runner exits at once (status `CRASH_EXIT`, 70,
like a crash) when it receives a prompt holding that token id; the fault tests use it for
"a request that crashes runners". With `KVSERVE_FAULT_LAYER_DELAY_S=<seconds>` it sleeps
that long before each layer's lease check, so that a SIGSTOP sent at a random moment lands
inside a step (the lease-fencing test).

This module only names the variables and parses their values; it knows nothing of sockets,
the scheduler or the model.
"""

from __future__ import annotations

from kvserve.config import ConfigError

CRASH_ON_TOKEN_ENV = "KVSERVE_FAULT_CRASH_ON_TOKEN"
CRASH_EXIT = 70
LAYER_DELAY_ENV = "KVSERVE_FAULT_LAYER_DELAY_S"


def _layer_delay(text: str) -> float:
    """The fault hook's per-layer delay in seconds (unset: 0; anything but a number from 0 to 1
    is a configuration error that names the variable)."""
    if not text.strip():
        return 0.0
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise ConfigError(f"{LAYER_DELAY_ENV}={text!r}: want seconds from 0 to 1")
    return value
