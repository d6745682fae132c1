"""A real `kvserve memsvc --device auto --dtype auto` resolves both the way the runners do
(kvserve.config.devices), so that `kvserve serve` can hand "auto" to both sides."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.config.devices import resolve_device, resolve_dtype
from kvserve.memsvc.client import MemClient, MemsvcError

pytestmark = pytest.mark.timeout(90)


def test_auto_resolves_like_the_runner(run_dir: Path, memsvc_factory) -> None:
    device = resolve_device("auto")
    dtype = resolve_dtype("auto", device)
    other = "float32" if dtype != "float32" else "float16"
    with memsvc_factory(run_dir, "--device", "auto", "--dtype", "auto") as svc:
        client = MemClient(svc.address, name="auto-check", timeout_s=5.0)
        try:
            with pytest.raises(MemsvcError, match="dtype"):
                client.attach(n_layers=2, n_kv_heads=2, head_dim=8, dtype=other)
            layout = client.attach(n_layers=2, n_kv_heads=2, head_dim=8, dtype=dtype)
        finally:
            client.close()
        assert (layout.dtype, layout.device.split(":")[0]) == (dtype, device)
        assert f'device="{device}' in svc.metrics()
