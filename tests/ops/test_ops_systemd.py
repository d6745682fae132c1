"""ops/systemd checked with `systemd-analyze verify`, plus the properties the service relies on.

`systemd-analyze verify` needs the executables a unit names to exist and the units it
depends on (sysinit.target, ...) to load. The test therefore builds a throwaway root:
the host's /usr/lib/systemd/system, the kvserve units in /etc/systemd/system, a stand-in
/opt/kvserve/venv/bin/kvserve and /bin/sh, and runs `verify --root`. It works unprivileged
inside a container (no running systemd needed). Any message on stderr fails the test, since
verify reports unknown keys and bad values as warnings with exit status 0.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from .opsfiles import OPS, SYSTEMD_DIR

UNITS = ("kvserve-memsvc.service", "kvserve-runner@.service", "kvserve-frontend.service",
         "kvserve.target")
SERVICES = UNITS[:3]
KVSERVE_BIN = "/opt/kvserve/venv/bin/kvserve"


def _directives(unit: str) -> list[tuple[str, str]]:
    """(key, value) of every assignment, in order; keys may repeat (DeviceAllow=)."""
    out = []
    for line in (SYSTEMD_DIR / unit).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            out.append((key.strip(), value.strip()))
    return out


def _get(unit: str, key: str) -> list[str]:
    return [v for k, v in _directives(unit) if k == key]


def _fake_root(tmp: Path) -> Path:
    root = tmp / "root"
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    for unit in UNITS:
        shutil.copy(SYSTEMD_DIR / unit, root / "etc/systemd/system" / unit)
    (root / "etc/systemd/system/kvserve-runner@0.service").symlink_to("kvserve-runner@.service")
    (root / "etc/systemd/system/kvserve-runner@1.service").symlink_to("kvserve-runner@.service")
    (root / "etc/kvserve").mkdir(parents=True)
    shutil.copy(OPS / "kvserve.env", root / "etc/kvserve/kvserve.env")
    fake = root / KVSERVE_BIN.lstrip("/")
    fake.parent.mkdir(parents=True)
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    (root / "bin").mkdir()
    shutil.copy("/bin/sh", root / "bin/sh")
    return root


@pytest.mark.timeout(60)
def test_systemd_analyze_verify(systemd_analyze: str, tmp_path: Path) -> None:
    root = _fake_root(tmp_path)
    names = ["kvserve-memsvc.service", "kvserve-runner@0.service", "kvserve-runner@1.service",
             "kvserve-frontend.service", "kvserve.target"]
    res = subprocess.run([systemd_analyze, "verify", f"--root={root}", "--man=no", *names],
                         cwd=root / "etc/systemd/system", capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0 and not res.stderr.strip(), res.stdout + res.stderr


@pytest.mark.timeout(60)
def test_systemd_analyze_verify_catches_a_bad_unit(systemd_analyze: str, tmp_path: Path) -> None:
    """The check above is only worth something if verify really objects to mistakes here."""
    root = _fake_root(tmp_path)
    bad = root / "etc/systemd/system/kvserve-bad.service"
    text = (SYSTEMD_DIR / "kvserve-frontend.service").read_text()
    bad.write_text(text.replace("WatchdogSec=", "WatchdogSecs=").replace(KVSERVE_BIN, "/opt/nope"))
    res = subprocess.run([systemd_analyze, "verify", f"--root={root}", "--man=no",
                          "kvserve-bad.service"], cwd=bad.parent, capture_output=True,
                         text=True, timeout=60)
    assert "WatchdogSecs" in res.stderr and res.returncode != 0, res.stderr


@pytest.mark.parametrize("unit", SERVICES)
def test_service_lifecycle_and_hardening(unit: str) -> None:
    assert _get(unit, "Type") == ["notify"]
    assert _get(unit, "NotifyAccess") == ["main"]
    assert _get(unit, "Restart") == ["on-failure"]
    (watchdog,) = _get(unit, "WatchdogSec")
    assert re.fullmatch(r"\d+s", watchdog) and int(watchdog[:-1]) >= 10
    assert _get(unit, "User") == ["kvserve"] and _get(unit, "Group") == ["kvserve"]
    assert _get(unit, "RuntimeDirectory") == ["kvserve"]
    assert _get(unit, "RuntimeDirectoryPreserve") == ["yes"], "a restart would delete sockets"
    assert _get(unit, "EnvironmentFile") == ["/etc/kvserve/kvserve.env"]
    for key, value in (("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"),
                       ("PrivateTmp", "yes"), ("DevicePolicy", "closed"),
                       ("ProtectHome", "yes")):
        assert _get(unit, key) == [value], f"{unit}: {key}"
    if unit != "kvserve-frontend.service":
        assert not _get(unit, "ProtectProc") and not _get(unit, "ProcSubset"), (
            "runners open memsvc's memfds through /proc/<pid>/fd")
    assert _get(unit, "SystemCallFilter")[0] == "@system-service", unit
    assert "@privileged" in _get(unit, "SystemCallFilter")[1].removeprefix("~").split(), unit
    assert _get(unit, "SystemCallErrorNumber") == ["EPERM"], unit
    assert _get(unit, "IPAddressDeny") == ["any"] and _get(unit, "IPAddressAllow") == ["localhost"]
    assert _get(unit, "RemoveIPC") == ["yes"] and _get(unit, "PrivateMounts") == ["yes"], unit
    for dev in _get(unit, "DeviceAllow"):
        path = dev.split()[0]
        assert path.startswith(("/dev/nvidia", "char-nvidia")), f"{unit}: DeviceAllow={dev}"
    assert _get(unit, "WantedBy") == ["kvserve.target"]
    assert _get(unit, "PartOf") == ["kvserve.target"]


def test_gpu_units_see_the_gpus_and_the_frontend_none() -> None:
    for unit in ("kvserve-memsvc.service", "kvserve-runner@.service"):
        allowed = {d.split()[0] for d in _get(unit, "DeviceAllow")}
        assert {"/dev/nvidiactl", "/dev/nvidia-uvm", "char-nvidia-frontend"} <= allowed
    assert not _get("kvserve-frontend.service", "DeviceAllow")
    assert _get("kvserve-frontend.service", "PrivateDevices") == ["yes"]


def test_gpu_units_keep_their_devices_and_only_the_runner_locks_memory() -> None:
    """PrivateDevices=yes would hide /dev/nvidia* from CUDA (the runner's unit says why)."""
    for unit in ("kvserve-memsvc.service", "kvserve-runner@.service"):
        assert not _get(unit, "PrivateDevices"), unit
    assert "PrivateDevices=yes" in (SYSTEMD_DIR / "kvserve-runner@.service").read_text()
    assert not _get("kvserve-memsvc.service", "LimitMEMLOCK")
    assert not _get("kvserve-frontend.service", "LimitMEMLOCK")


# `systemd-analyze security` exposure (0 = locked down, 10 = fully exposed) each unit must
# stay at or under: the runner gets more room for CUDA (devices, @resources, MEMLOCK).
EXPOSURE_LIMITS = {"kvserve-memsvc.service": 2.0, "kvserve-runner@.service": 2.5,
                   "kvserve-frontend.service": 2.0}
_EXPOSURE_RE = re.compile(r"Overall exposure level for (\S+): (\d+(?:\.\d+)?)")


def _exposure(systemd_analyze: str, path: Path) -> float:
    """The overall exposure `systemd-analyze security --offline=true` gives the unit file."""
    res = subprocess.run([systemd_analyze, "security", "--offline=true", "--no-pager", str(path)],
                         capture_output=True, text=True, timeout=60)
    found = _EXPOSURE_RE.findall(res.stdout + res.stderr)
    assert res.returncode == 0 and len(found) == 1, (
        f"no single 'Overall exposure level' line for {path}:\n{res.stdout}{res.stderr}")
    return float(found[0][1])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("unit", SERVICES)
def test_systemd_security_exposure(systemd_analyze: str, unit: str) -> None:
    score = _exposure(systemd_analyze, SYSTEMD_DIR / unit)
    assert score <= EXPOSURE_LIMITS[unit], f"{unit}: exposure {score} > {EXPOSURE_LIMITS[unit]}"


@pytest.mark.timeout(60)
def test_systemd_security_exposure_catches_a_loose_unit(systemd_analyze: str,
                                                       tmp_path: Path) -> None:
    """The frontend without its hardening block must score over every limit above."""
    text = (SYSTEMD_DIR / "kvserve-frontend.service").read_text()
    service, _, rest = text.partition("\nNoNewPrivileges=")
    loose = tmp_path / "kvserve-loose.service"
    loose.write_text(service + "\n[Install]" + rest.partition("[Install]")[2])
    assert "SystemCallFilter" not in loose.read_text()
    assert _exposure(systemd_analyze, loose) > max(EXPOSURE_LIMITS.values())


def test_runner_is_bound_to_memsvc_and_uses_its_instance() -> None:
    unit = "kvserve-runner@.service"
    assert "kvserve-memsvc.service" in " ".join(_get(unit, "BindsTo")).split()
    assert "kvserve-memsvc.service" in " ".join(_get(unit, "After")).split()
    (cmd,) = _get(unit, "ExecStart")
    assert f"exec {KVSERVE_BIN} runner" in cmd
    assert "--device cuda:%i" in cmd and "--runner-id %i" in cmd
    assert "--metrics-port $$((9402 + %i))" in cmd


def test_port_arithmetic_of_runner_command_in_a_real_shell() -> None:
    """Run the runner's ExecStart through sh as systemd would (after %i and $$ expansion)."""
    (cmd,) = _get("kvserve-runner@.service", "ExecStart")
    script = re.fullmatch(r"/bin/sh -c '(.*)'", cmd).group(1)
    script = script.replace("%i", "3").replace("$$", "$").replace(f"exec {KVSERVE_BIN}", "echo")
    out = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["runner", "--device", "cuda:3", "--runner-id", "3",
                                  "--metrics-port", "9405"]


def test_memsvc_and_frontend_commands() -> None:
    (memsvc,) = _get("kvserve-memsvc.service", "ExecStart")
    (frontend,) = _get("kvserve-frontend.service", "ExecStart")
    assert memsvc.split() == [KVSERVE_BIN, "memsvc", "--metrics-port", "9401"]
    assert frontend.split() == [KVSERVE_BIN, "frontend", "--metrics-port", "9400"]


def test_target_pulls_in_memsvc_and_frontend() -> None:
    wants = " ".join(_get("kvserve.target", "Wants")).split()
    assert {"kvserve-memsvc.service", "kvserve-frontend.service"} <= set(wants)
    assert _get("kvserve.target", "WantedBy") == ["multi-user.target"]


def test_example_config_loads_into_every_process_config() -> None:
    import tomllib

    from kvserve.config import load_config
    from kvserve.config.frontend import FrontendConfig
    from kvserve.config.memsvc import MemsvcConfig
    from kvserve.config.runner import RunnerConfig
    from kvserve.config.serve import load_serve_config

    env = {}
    for line in (OPS / "kvserve.env").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value
    assert env.pop("KVSERVE_CONFIG") == "/etc/kvserve/kvserve.toml"
    sections = tomllib.loads((OPS / "kvserve.toml").read_text())
    classes = {"memsvc": MemsvcConfig, "runner": RunnerConfig, "frontend": FrontendConfig}
    assert set(sections) == {*classes, "serve"}
    for section, cls in classes.items():
        cfg = load_config(cls, section=section, toml_path=OPS / "kvserve.toml", env=env)
        for key, value in sections[section].items():
            assert getattr(cfg, key) == value, f"[{section}] {key}"
    field_sets = [{f.upper() for f in cls.__slots__} for cls in classes.values()]
    for key in env:
        assert any(key.removeprefix("KVSERVE_") in names for names in field_sets), key
    assert load_config(MemsvcConfig, section="memsvc", env=env).dtype == env["KVSERVE_DTYPE"]
    assert load_config(RunnerConfig, section="runner", env=env).dtype == env["KVSERVE_DTYPE"]
    # `kvserve serve` reads the same file: every child's table, and its own [serve]
    serve = load_serve_config(toml_path=OPS / "kvserve.toml", env=env)
    for section in classes:
        for key, value in sections[section].items():
            assert getattr(getattr(serve, section), key) == value, f"serve: [{section}] {key}"
    for key, value in sections["serve"].items():
        assert getattr(serve, key) == value, f"[serve] {key}"
    assert serve.memsvc.dtype == serve.runner.dtype == env["KVSERVE_DTYPE"]


@pytest.mark.parametrize("unit", SERVICES)
def test_config_errors_are_not_restarted(unit: str) -> None:
    assert _get(unit, "RestartPreventExitStatus") == ["2"]
