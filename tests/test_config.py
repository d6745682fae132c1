"""Config plumbing: precedence defaults < TOML < env < flags, errors that name the field, help
beside each field, configs back to flags, the device and address checks every process shares."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest

from kvserve.config import (
    ConfigError,
    add_dataclass_flags,
    config_from_args,
    load_config,
    option,
    parse_size,
    setting_fields,
    to_flags,
)
from kvserve.config.devices import DTYPES, cpu_has_native_bf16, resolve_device, resolve_dtype
from kvserve.config.frontend import FrontendConfig
from kvserve.config.memsvc import POLICY_NAMES, MemsvcConfig
from kvserve.config.runner import RunnerConfig
from kvserve.config.serve import ServeConfig


@dataclass(frozen=True)
class Conf:
    port: int = 1
    name: str = "a"
    ratio: float = 0.5
    on: bool = False
    tag: str | None = None

    def __post_init__(self) -> None:
        if self.port < 0:
            raise ConfigError(f"port must be >= 0, got {self.port}")


def test_precedence(tmp_path) -> None:
    toml = tmp_path / "k.toml"
    toml.write_text('[svc]\nport = 2\nname = "toml"\nratio = 0.25\n')
    conf = load_config(Conf, section="svc", toml_path=toml, env={"KVSERVE_NAME": "env"},
                       overrides={"ratio": "0.75", "on": None})
    assert conf == Conf(port=2, name="env", ratio=0.75, on=False)


def test_env_and_errors(tmp_path) -> None:
    assert load_config(Conf, section="svc", env={"KVSERVE_ON": "yes"}).on is True
    with pytest.raises(ConfigError, match="KVSERVE_PORT"):
        load_config(Conf, section="svc", env={"KVSERVE_PORT": "eight"})
    with pytest.raises(ConfigError, match="port must be >= 0"):
        load_config(Conf, section="svc", env={}, overrides={"port": -1})
    bad = tmp_path / "bad.toml"
    bad.write_text("[svc]\nprot = 3\n")
    with pytest.raises(ConfigError, match="unknown key 'prot'"):
        load_config(Conf, section="svc", toml_path=bad, env={})
    with pytest.raises(ConfigError, match="not found"):
        load_config(Conf, section="svc", toml_path=tmp_path / "missing.toml", env={})
    broken = tmp_path / "broken.toml"
    broken.write_text("[svc\n")
    with pytest.raises(ConfigError, match="broken.toml"):
        load_config(Conf, section="svc", toml_path=broken, env={})


def test_flags_from_dataclass(monkeypatch) -> None:
    monkeypatch.delenv("KVSERVE_PORT", raising=False)
    parser = argparse.ArgumentParser()
    add_dataclass_flags(parser, Conf)
    args = parser.parse_args(["--port", "7", "--on"])
    conf = config_from_args(Conf, args, section="svc")
    assert (conf.port, conf.on, conf.name) == (7, True, "a")
    assert "(default: 1)" in parser.format_help()


@pytest.mark.parametrize(("text", "size"), [("2GiB", 2 * 1024**3), ("512MB", 512 * 10**6), ("100", 100)])
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


def test_parse_size_rejects() -> None:
    with pytest.raises(ConfigError, match="not a size"):
        parse_size("two gigs")


@dataclass(frozen=True)
class Documented:
    count: int = option(3, help="how many widgets to make")
    label: str | None = option(None, help="widget label (default: none)")
    ratio: float = option(1.5, help="widget ratio")
    loud: bool = option(False, help="make noise")


def test_help_is_read_from_the_field() -> None:
    parser = argparse.ArgumentParser()
    add_dataclass_flags(parser, Documented)
    text = " ".join(parser.format_help().split())
    assert "how many widgets to make (default: 3)" in text
    assert "widget label (default: none)" in text and "(default: None)" not in text
    assert "--loud, --no-loud" in text


@pytest.mark.parametrize("cfg", [
    Documented(), Documented(count=0, label="-dash=eq", ratio=1e-5, loud=True), Documented(ratio=-2.0),
])
def test_to_flags_rebuilds_the_config(cfg: Documented) -> None:
    parser = argparse.ArgumentParser()
    add_dataclass_flags(parser, Documented)
    flags = to_flags(cfg)
    assert all(f.startswith("--") for f in flags)
    assert config_from_args(Documented, parser.parse_args(flags), section="x") == cfg


def test_to_flags_writes_only_what_differs_and_what_is_asked() -> None:
    assert to_flags(Documented()) == []
    assert to_flags(Documented(count=4), always=["ratio"]) == ["--count=4", "--ratio=1.5"]
    assert to_flags(Documented(loud=True)) == ["--loud"]


@pytest.mark.parametrize("cls", [MemsvcConfig, RunnerConfig, FrontendConfig, ServeConfig])
def test_every_setting_has_its_help_beside_it(cls: type) -> None:
    for name, (f, _) in setting_fields(cls).items():
        assert f.metadata.get("help"), f"{cls.__name__}.{name} has no help"


def test_process_configs_round_trip_through_their_own_cli(monkeypatch) -> None:
    """What serve hands a child (to_flags) is what the child's own parser rebuilds."""
    from kvserve.frontend.main import build_parser as frontend_parser
    from kvserve.memsvc.server import build_parser as memsvc_parser
    from kvserve.runner.main import build_parser as runner_parser

    for var in [v for v in os.environ if v.startswith("KVSERVE_")]:
        monkeypatch.delenv(var)
    cases = [
        (MemsvcConfig(kv_memory="1GiB", device="auto", dtype="bfloat16", allow_remote=True,
                      address="tcp://10.0.0.1:5"), memsvc_parser, "memsvc"),
        (RunnerConfig(model="/m.gguf", chunk_size=8, runner_id="r 1", threads=2), runner_parser, "runner"),
        (FrontendConfig(max_stop_strings=1, runner_timeout_s=0.25, tokenizer="bytes"), frontend_parser,
         "frontend"),
    ]
    for cfg, build_parser, section in cases:
        args = build_parser().parse_args(to_flags(cfg))
        assert config_from_args(type(cfg), args, section=section) == cfg


def test_memsvc_policy_names_are_the_registered_policies() -> None:
    from kvserve.memsvc.policy import POLICIES

    assert sorted(POLICIES) == list(POLICY_NAMES)


@pytest.mark.parametrize(("cfg_kw", "cls", "flag"), [
    ({"address": "tcp://10.1.2.3:5"}, MemsvcConfig, "--address"),
    ({"frontend_address": "tcp://10.1.2.3:5"}, FrontendConfig, "--frontend-address"),
])
def test_one_address_check_names_the_field(cfg_kw: dict, cls: type, flag: str) -> None:
    with pytest.raises(ConfigError, match=f"^{flag}: 10.1.2.3 is not a loopback address"):
        cls(**cfg_kw)
    with pytest.raises(ConfigError, match=f"^{flag}: 'tcp://127.0.0.1' is not tcp://HOST:PORT"):
        cls(**{next(iter(cfg_kw)): "tcp://127.0.0.1"})


@pytest.mark.parametrize(("kw", "message"), [
    ({"kv_events_endpoint": "tcp://127.0.0.1:5557"},
     "^--kv-events-endpoint and --kv-events-replay-endpoint go together"),
    ({"kv_events_endpoint": "tcp://127.0.0.1:5557", "kv_events_replay_endpoint": "tcp://127.0.0.1:5557"},
     "^--kv-events-replay-endpoint: tcp://127.0.0.1:5557 is also --kv-events-endpoint"),
    ({"kv_events_endpoint": "ipc:///tmp/ev", "kv_events_replay_endpoint": "tcp://127.0.0.1:5558"},
     "^--kv-events-endpoint: 'ipc:///tmp/ev' must be tcp://HOST:PORT"),
    ({"kv_events_endpoint": "tcp://*:5557", "kv_events_replay_endpoint": "tcp://127.0.0.1:5558"},
     "^--kv-events-endpoint: 'tcp://\\*:5557' needs a concrete host"),
    ({"kv_events_endpoint": "tcp://127.0.0.1:5557", "kv_events_replay_endpoint": "tcp://10.0.0.2:5558"},
     "^--kv-events-replay-endpoint: 10.0.0.2 is not a loopback address"),
    ({"kv_events_endpoint": "tcp://10.0.0.2:5557", "kv_events_replay_endpoint": "tcp://10.0.0.2:5558",
      "allow_remote": True},
     "^--kv-events-endpoint: tcp://10.0.0.2:5557 is not loopback and KV events carry prompt token ids: give "
     "--curve-secret-key-file"),
    ({"kv_event_block_size": 0}, "^--kv-event-block-size: must be >= 1, got 0"),
    ({"kv_event_block_size": 12, "page_size": 8}, "^--kv-event-block-size 12: must be a multiple of --page-size 8"),
])
def test_kv_event_settings_are_checked(kw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        MemsvcConfig(**kw)
    remote = {"kv_events_endpoint": "tcp://10.0.0.2:5557", "kv_events_replay_endpoint": "tcp://10.0.0.2:5558",
              "allow_remote": True}
    cfg = MemsvcConfig(**remote, kv_events_plaintext=True, kv_event_block_size=32, page_size=16)
    assert cfg.kv_event_block_size == 32
    # with memsvc's CURVE keys the events go over CURVE (the files are read at start, not here)
    assert MemsvcConfig(**remote, curve_secret_key_file="k", curve_public_keys_dir="d").kv_events_endpoint


def test_devices_one_dtype_list_and_auto() -> None:
    for cls in (MemsvcConfig, RunnerConfig):
        assert cls(dtype="auto", device="auto").dtype == "auto"
        with pytest.raises(ConfigError, match="^--dtype: 'int8' is not one of auto, float32"):
            cls(dtype="int8")
        with pytest.raises(ConfigError, match="^--device: 'cuda:x' is not cpu, cuda, cuda:N or auto"):
            cls(device="cuda:x")
    assert DTYPES == ("auto", "float32", "bfloat16", "float16")
    assert resolve_device("cpu") == "cpu" and resolve_dtype("float16", "cpu") == "float16"
    assert resolve_dtype("auto", "cuda:1") == "bfloat16"
    assert cpu_has_native_bf16("flags\t: fpu sse avx512_bf16\n") and not cpu_has_native_bf16("flags\t: fpu\n")
    standalone = MemsvcConfig()
    assert (standalone.device, standalone.dtype) == ("cpu", "float32")


def test_config_package_is_stdlib_only() -> None:
    code = ("import sys\nimport kvserve.config.serve, kvserve.config.devices, kvserve.config.checks\n"
            "kv = sorted(m for m in sys.modules if m.startswith('kvserve') and not m.startswith('kvserve.config'))\n"
            "third = sorted({m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names)\n"
            "               - {'kvserve', '__main__'})\n"
            "print([m for m in kv if m != 'kvserve'], [m for m in third if not m.startswith('_')])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[] []"


@pytest.mark.parametrize("text", ["x", "-0.1", "2", "nan"])
def test_fault_layer_delay_is_checked(text: str) -> None:
    from kvserve.runner.faults import _layer_delay

    assert _layer_delay("") == 0.0 and _layer_delay("0.004") == 0.004
    with pytest.raises(ConfigError, match=rf"KVSERVE_FAULT_LAYER_DELAY_S='{text}': want seconds from 0 to 1"):
        _layer_delay(text)


def test_tool_call_parser_is_a_family_none_or_unset() -> None:
    from kvserve.config.frontend import FAMILY_NAMES, FrontendConfig
    from kvserve.model.tool_parsers import FAMILIES

    assert tuple(FAMILIES) == FAMILY_NAMES
    for name in ("", "none", *FAMILY_NAMES):
        assert FrontendConfig(tool_call_parser=name).tool_call_parser == name
    with pytest.raises(ConfigError, match="^--tool-call-parser: 'qwen' is not one of hermes, llama3_json, mistral"):
        FrontendConfig(tool_call_parser="qwen")
