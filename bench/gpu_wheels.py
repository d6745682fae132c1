"""Download the wheels the GPU host lacks: `python bench/gpu_wheels.py [--dest .whl]`.

The H200 host of `make gpu-check` has no network and a Python 3.12 with torch, triton,
transformers, tokenizers, safetensors, numpy, jinja2, prometheus-client, pytest and
pytest-timeout, but not the rest of what kvserve imports. This fetches exactly those
packages, at the versions installed here (the ones CI tests), as CPython 3.12 manylinux
x86-64 wheels, without their dependencies (each one needed is named below).
bench/gpu_check.sh installs them into a private target dir before anything imports them.
grpcio and protobuf travel too: the generated stubs in kvserve/v1 need at least the
versions they were generated with, and the host's may be older.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib import metadata
from pathlib import Path

PACKAGES = (
    "pyzmq", "msgspec", "gguf", "grpcio", "grpcio-health-checking", "grpcio-reflection",
    "protobuf", "fastapi", "starlette", "uvicorn", "httptools", "pydantic", "pydantic-core",
    "annotated-types", "typing-inspection", "typing-extensions", "annotated-doc", "opentelemetry-api",
)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_5_x86_64", "any")
LIMIT_MIB = 40


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=Path(".whl"))
    args = parser.parse_args(argv)
    args.dest.mkdir(exist_ok=True)
    specs = []
    for name in PACKAGES:
        try:
            specs.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            print(f"gpu_wheels: {name} is not installed here (run make install)", file=sys.stderr)
            return 2
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312",
           "--abi", "abi3", "--abi", "none", "-d", str(args.dest)]
    for plat in PLATFORMS:
        cmd += ["--platform", plat]
    subprocess.run(cmd + specs, check=True)
    wheels = sorted(args.dest.glob("*.whl"))
    stale = [w for w in wheels if not any(_matches(w, s) for s in specs)]
    for w in stale:  # an older download of another version would stop the install there
        w.unlink()
    wheels = [w for w in wheels if w not in stale]
    total = sum(w.stat().st_size for w in wheels) / 2**20
    for w in wheels:
        print(f"{w.stat().st_size / 2**20:7.2f} MiB  {w.name}")
    print(f"{total:7.2f} MiB in {len(wheels)} wheels (limit {LIMIT_MIB} MiB)")
    return 0 if total <= LIMIT_MIB and len(wheels) == len(specs) else 1


def _matches(wheel: Path, spec: str) -> bool:
    name, version = spec.split("==")
    dist, ver = wheel.name.split("-")[:2]
    return dist.lower().replace("_", "-") == name.lower() and ver == version


if __name__ == "__main__":
    sys.exit(main())
