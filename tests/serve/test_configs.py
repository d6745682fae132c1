"""FrontendConfig / ServeConfig range checks and the serve supervisor's child command lines."""

from __future__ import annotations

import pytest

from kvserve.config import ConfigError
from kvserve.config.frontend import FrontendConfig, ServeConfig
from kvserve.serve.main import Supervisor


def test_metrics_ports_follow_the_base() -> None:
    cfg = ServeConfig(runners=2, metrics_port=9400)
    assert [cfg.child_metrics_port("frontend"), cfg.child_metrics_port("memsvc"),
            cfg.child_metrics_port("runner", 0), cfg.child_metrics_port("runner", 1)] == [9400, 9401, 9402, 9403]
    assert ServeConfig(metrics_port=0).child_metrics_port("runner", 3) == 0


@pytest.mark.parametrize(("kw", "flag"), [
    ({"dtype": "int8"}, "--dtype"), ({"device": "tpu"}, "--device"), ({"runners": 0}, "--runners"),
    ({"port": 0}, "--port"), ({"metrics_port": 65534, "runners": 4}, "--metrics-port"),
])
def test_serve_config_rejects(kw: dict, flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        ServeConfig(**kw)


@pytest.mark.parametrize(("kw", "flag"), [
    ({"max_waiting": 0}, "--max-waiting"), ({"port": 70000}, "--port"),
    ({"tls_cert": "c.pem"}, "--tls-cert"), ({"max_prompt_tokens": -1}, "--max-prompt-tokens"),
])
def test_frontend_config_rejects(kw: dict, flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        FrontendConfig(**kw)


def test_children_name_their_role_and_share_addresses(tmp_path) -> None:
    sup = Supervisor(ServeConfig(runners=2, device="cpu", model="/m.gguf", port=6000), tmp_path)
    roles = [c.argv[3] for c in sup.children]
    assert roles == ["memsvc", "runner", "runner", "frontend"]
    assert all(c.argv[1:3] == ["-m", "kvserve.cli"] for c in sup.children)
    runner1 = sup.children[2].argv
    for flag, value in [("--runner-id", "runner-1"), ("--metrics-port", "9403"), ("--model", "/m.gguf"),
                        ("--memsvc-address", f"ipc://{tmp_path}/memsvc.sock"),
                        ("--frontend-address", f"ipc://{tmp_path}/frontend.sock"), ("--device", "cpu")]:
        assert runner1[runner1.index(flag) + 1] == value
    frontend = sup.children[3].argv
    assert frontend[frontend.index("--port") + 1] == "6000"
    assert frontend[frontend.index("--metrics-port") + 1] == "9400"
