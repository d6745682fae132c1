"""`kvserve serve`'s config: ServeConfig composed of the children's configs, the precedence
defaults < [child] table < [serve] < KVSERVE_* < flags, validation before anything starts,
and the command lines the supervisor hands each child."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.config import ConfigError, config_from_args, load_config
from kvserve.config.frontend import FrontendConfig
from kvserve.config.memsvc import MemsvcConfig
from kvserve.config.serve import EXPOSED, ServeConfig, load_serve_config
from kvserve.serve.main import Supervisor, build_parser

FILE = """
[memsvc]
kv_tokens = 100
page_size = 4
[runner]
chunk_size = 8
runner_id = "from-the-file"
metrics_port = 1234
[frontend]
max_stop_strings = 1
port = 7001
"""


@pytest.fixture
def toml(tmp_path: Path) -> Path:
    path = tmp_path / "kvserve.toml"
    path.write_text(FILE)
    return path


def _argv_flags(argv: list[str]) -> dict[str, str]:
    return dict(arg.split("=", 1) for arg in argv[4:])


def test_metrics_ports_follow_the_base() -> None:
    cfg = ServeConfig(runners=2, metrics_port=9400)
    assert [cfg.child_metrics_port("frontend"), cfg.child_metrics_port("memsvc"),
            cfg.child_metrics_port("runner", 0), cfg.child_metrics_port("runner", 1)] == [9400, 9401, 9402, 9403]
    assert ServeConfig(metrics_port=0).child_metrics_port("runner", 3) == 0


@pytest.mark.parametrize(("flags", "message"), [
    ({"dtype": "int8"}, "--dtype"), ({"device": "tpu"}, "--device"), ({"runners": 0}, "--runners"),
    ({"port": 0}, "--port"), ({"metrics_port": 65534, "runners": 4}, "--metrics-port"),
    ({"kv_tokens": "many"}, "--kv-tokens: 'many' is not a valid int"),
    ({"policy": "greedy"}, "memsvc settings: --policy"),
])
def test_serve_config_rejects(flags: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_serve_config(env={}, flags=flags)


@pytest.mark.parametrize(("kw", "flag"), [
    ({"max_waiting": 0}, "--max-waiting"), ({"port": 70000}, "--port"),
    ({"tls_cert": "c.pem"}, "--tls-cert"), ({"max_prompt_tokens": -1}, "--max-prompt-tokens"),
])
def test_frontend_config_rejects(kw: dict, flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        FrontendConfig(**kw)


def test_exposed_settings_are_child_fields_not_copies() -> None:
    own = {f.name for f in dataclasses.fields(ServeConfig)}
    assert own == {"runners", "metrics_port", "runtime_dir", "ready_timeout_s", "max_restarts",
                   "restart_window_s", "memsvc", "runner", "frontend"}
    flags = {a.dest for a in build_parser()._actions} - {"help", "config"}
    assert flags == (own - {"memsvc", "runner", "frontend"}) | set(EXPOSED)
    assert len(flags) == 34  # 29, + --host-cache-bytes, --disk-cache-dir, --disk-cache-bytes (issue 20),
    #                          --batch-invariant (36), --tool-call-parser (37)


@pytest.mark.parametrize(("layers", "expected"), [
    ({}, None),
    ({"memsvc_table": True}, 100),
    ({"memsvc_table": True, "serve_table": True}, 200),
    ({"memsvc_table": True, "serve_table": True, "env": True}, 300),
    ({"memsvc_table": True, "serve_table": True, "env": True, "flag": True}, 400),
    ({"env": True, "flag": True}, 400),
])
def test_precedence_of_a_child_setting(tmp_path: Path, layers: dict, expected: int | None) -> None:
    text = ""
    if layers.get("memsvc_table"):
        text += "[memsvc]\nkv_tokens = 100\n"
    if layers.get("serve_table"):
        text += "[serve]\nkv_tokens = 200\n"
    path = tmp_path / "k.toml"
    path.write_text(text)
    env = {"KVSERVE_KV_TOKENS": "300"} if layers.get("env") else {}
    flags = {"kv_tokens": "400" if layers.get("flag") else None}
    assert load_serve_config(toml_path=path, env=env, flags=flags).memsvc.kv_tokens == expected


def test_zero_kv_tokens_and_empty_policy_leave_memsvc_its_defaults(tmp_path: Path) -> None:
    """`kvserve serve --kv-tokens 0 --policy ''` has always meant "memsvc's defaults"."""
    path = tmp_path / "k.toml"
    path.write_text("[memsvc]\nkv_tokens = 100\npolicy = 'optimistic'\n[serve]\nkv_tokens = 0\n")
    cfg = load_serve_config(toml_path=path, env={}, flags={"kv_tokens": None, "policy": ""})
    assert (cfg.memsvc.kv_tokens, cfg.memsvc.policy) == (100, "optimistic")
    cfg = load_serve_config(env={}, flags={"kv_tokens": "0", "policy": ""})
    assert (cfg.memsvc.kv_tokens, cfg.memsvc.policy) == (MemsvcConfig().kv_tokens, MemsvcConfig().policy)
    assert load_serve_config(env={}, flags={"kv_tokens": "5"}).memsvc.kv_tokens == 5


def test_precedence_of_serves_own_setting(tmp_path: Path) -> None:
    path = tmp_path / "k.toml"
    path.write_text("[serve]\nrunners = 2\nmax_restarts = 7\n")
    cfg = load_serve_config(toml_path=path, env={"KVSERVE_RUNNERS": "3"}, flags={"max_restarts": "8"})
    assert (cfg.runners, cfg.max_restarts, cfg.restart_window_s) == (3, 8, 60.0)


def test_the_file_fills_every_child(toml: Path) -> None:
    cfg = load_serve_config(toml_path=toml, env={}, flags={"model": "/m.gguf", "device": "cpu"})
    assert (cfg.memsvc.kv_tokens, cfg.memsvc.page_size, cfg.runner.chunk_size) == (100, 4, 8)
    assert (cfg.frontend.max_stop_strings, cfg.frontend.port) == (1, 7001)
    assert cfg.memsvc.model == cfg.runner.model == cfg.frontend.model == "/m.gguf"
    assert cfg.memsvc.device == cfg.runner.device == "cpu"


def test_kvserve_config_variable_names_the_file(toml: Path) -> None:
    assert load_serve_config(env={"KVSERVE_CONFIG": str(toml)}).memsvc.kv_tokens == 100


def test_under_serve_memsvc_resolves_auto_like_the_runners() -> None:
    cfg = load_serve_config(env={})
    assert (cfg.memsvc.device, cfg.memsvc.dtype) == ("auto", "auto") == (cfg.runner.device, cfg.runner.dtype)
    alone = load_config(MemsvcConfig, section="memsvc", env={})
    assert (alone.device, alone.dtype) == ("cpu", "float32")


@pytest.mark.parametrize(("text", "message"), [
    ("[runner]\nmax_runing = 3\n", r"k.toml: \[runner\] unknown key 'max_runing'"),
    ("[serve]\nchunk_size = 3\n", r"k.toml: \[serve\] unknown key 'chunk_size'"),
    ("[runner]\nmax_running = 0\n", "runner settings: --max-running: must be >= 1, got 0"),
    ("[frontend]\nport = \"x\"\n", r"k.toml: \[frontend\] port: 'x' is not a valid int"),
    ("[memsvc]\ndtype = \"float16\"\n[runner]\ndtype = \"bfloat16\"\n", "--dtype: .* differ"),
    ("[runner]\nmodel = \"/a.gguf\"\n", "--model: the children's models differ"),
])
def test_bad_tables_are_refused_before_anything_starts(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "k.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_serve_config(toml_path=path, env={})


def test_cli_exits_2_naming_file_table_and_key(tmp_path: Path) -> None:
    path = tmp_path / "k.toml"
    path.write_text("[runner]\nmax_runing = 3\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSERVE_")}
    out = subprocess.run([sys.executable, "-m", "kvserve.cli", "serve", "--config", str(path)],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2
    assert f"config file {path}: [runner] unknown key 'max_runing'" in out.stderr


def test_children_name_their_role_and_share_addresses(tmp_path: Path) -> None:
    cfg = load_serve_config(env={}, flags={"runners": 2, "device": "cpu", "model": "/m.gguf", "port": 6000})
    sup = Supervisor(cfg, tmp_path)
    assert [c.argv[3] for c in sup.children] == ["memsvc", "runner", "runner", "frontend"]
    assert all(c.argv[1:3] == ["-m", "kvserve.cli"] for c in sup.children)
    runner1 = _argv_flags(sup.children[2].argv)
    for flag, value in [("--runner-id", "runner-1"), ("--metrics-port", "9403"), ("--model", "/m.gguf"),
                        ("--memsvc-address", f"ipc://{tmp_path}/memsvc.sock"),
                        ("--frontend-address", f"ipc://{tmp_path}/frontend.sock"), ("--device", "cpu"),
                        ("--runtime-dir", str(tmp_path))]:
        assert runner1[flag] == value, flag
    assert "--dtype" not in runner1  # the runner's own default, "auto"
    memsvc = _argv_flags(sup.children[0].argv)
    assert (memsvc["--dtype"], memsvc["--model"], memsvc["--address"]) == (
        "auto", "/m.gguf", f"ipc://{tmp_path}/memsvc.sock")
    frontend = _argv_flags(sup.children[3].argv)
    assert (frontend["--port"], frontend["--metrics-port"]) == ("6000", "9400")


def test_each_child_rebuilds_exactly_what_serve_validated(toml: Path, tmp_path: Path, monkeypatch) -> None:
    from kvserve.frontend.main import build_parser as frontend_parser
    from kvserve.memsvc.server import build_parser as memsvc_parser
    from kvserve.runner.main import build_parser as runner_parser

    cfg = load_serve_config(toml_path=toml, env={}, flags={"port": "6001", "metrics_port": 0})
    sup = Supervisor(cfg, tmp_path)
    for var in [v for v in os.environ if v.startswith("KVSERVE_")]:
        monkeypatch.delenv(var)
    parsers = {"memsvc": memsvc_parser, "runner": runner_parser, "frontend": frontend_parser}
    built = {}
    for child in sup.children:
        args = parsers[child.role]().parse_args(child.argv[4:])
        built[child.name] = config_from_args(type(getattr(cfg, child.role)), args, section=child.role)
    assert built["memsvc"] == dataclasses.replace(
        cfg.memsvc, address=f"ipc://{tmp_path}/memsvc.sock", metrics_port=0, runtime_dir=str(tmp_path))
    # serve sets the runner's id and metrics port over what [runner] says; the rest is the file's
    assert built["runner-0"] == dataclasses.replace(
        cfg.runner, runner_id="runner-0", metrics_port=0, memsvc_address=f"ipc://{tmp_path}/memsvc.sock",
        frontend_address=f"ipc://{tmp_path}/frontend.sock", runtime_dir=str(tmp_path))
    assert built["runner-0"].chunk_size == 8
    assert (built["frontend"].port, built["frontend"].max_stop_strings) == (6001, 1)


def test_children_inherit_no_config_file_nor_their_settings_variables(tmp_path: Path) -> None:
    sup = Supervisor(ServeConfig(), tmp_path)
    runner = sup.by_role("runner")[0]
    assert {"KVSERVE_CONFIG", "KVSERVE_CHUNK_SIZE", "KVSERVE_DTYPE", "KVSERVE_RUNTIME_DIR"} <= runner.env_drop
    assert "KVSERVE_CACHE_DIR" not in runner.env_drop and "KVSERVE_KV_TOKENS" not in runner.env_drop
    assert "KVSERVE_KV_TOKENS" in sup.by_role("memsvc")[0].env_drop
