"""Config plumbing: precedence defaults < TOML < env < flags, and errors that name the field."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from kvserve.config import (
    ConfigError,
    add_dataclass_flags,
    config_from_args,
    load_config,
    parse_size,
)


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
