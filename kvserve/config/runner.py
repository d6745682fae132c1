"""`RunnerConfig`: the frozen configuration of one runner worker (`kvserve runner`).

Defaults here are the CLI defaults; `kvserve.config` fills the dataclass from a TOML
``[runner]`` table, ``KVSERVE_*`` environment variables and flags. This module also
resolves the "auto" choices (device, dtype, attention backend) from the host. It knows
nothing about sockets, memsvc or the model code.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvserve.config import ConfigError

DTYPES = ("auto", "float32", "bfloat16", "float16")
BACKENDS = ("auto", "torch", "triton")
HELP: dict[str, str] = {
    "model": "model: a .gguf file, a Hugging Face directory, or empty for the embedded default",
    "device": "cpu, cuda, cuda:N or auto",
    "dtype": "float32, bfloat16, float16 or auto (bf16 on CPUs with AMX/AVX512-BF16)",
    "memsvc_address": "memsvc ZMQ address (default ipc://<runtime-dir>/memsvc.sock)",
    "frontend_address": "frontend ROUTER address (default ipc://<runtime-dir>/frontend.sock)",
    "runner_id": "identity of this runner on the frontend socket and at memsvc",
    "metrics_port": "Prometheus metrics port (0 = off)",
    "attention_backend": "attention backend: torch, triton or auto (triton on cuda)",
    "max_running": "most requests running at once",
    "max_batch_tokens": "token budget of one scheduler step (prefill chunks + decodes)",
    "chunk_size": "most prompt tokens of one request computed in one step",
    "runtime_dir": "directory of ipc sockets (default: kvserve.paths.runtime_dir())",
    "threads": "torch CPU threads (0 = torch's default)",
    "seed": "seed of the generator used by unseeded sampled requests",
}


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    """Configuration of one runner worker; see `HELP` for each field."""

    model: str = ""
    device: str = "auto"
    dtype: str = "auto"
    memsvc_address: str = ""
    frontend_address: str = ""
    runner_id: str = "runner-0"
    metrics_port: int = 9402
    attention_backend: str = "auto"
    max_running: int = 256
    max_batch_tokens: int = 2048
    chunk_size: int = 512
    runtime_dir: str = ""
    threads: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype: {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.attention_backend not in BACKENDS:
            raise ConfigError(
                f"attention_backend: {self.attention_backend!r} is not one of {', '.join(BACKENDS)}"
            )
        dev = self.device
        if not (dev in ("auto", "cpu", "cuda") or (dev.startswith("cuda:") and dev[5:].isdigit())):
            raise ConfigError(f"device: {dev!r} is not cpu, cuda, cuda:N or auto")
        for name in ("max_running", "max_batch_tokens", "chunk_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port: {self.metrics_port} is not in 0..65535")
        if self.threads < 0:
            raise ConfigError(f"threads: must be >= 0, got {self.threads}")
        if not self.runner_id or not self.runner_id.isprintable() or len(self.runner_id) > 200:
            raise ConfigError(f"runner_id: {self.runner_id!r} must be 1-200 printable characters")


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """True when /proc/cpuinfo lists AMX-BF16 or AVX512-BF16 (native bf16 matrix math)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[-1].split())
            return bool(flags & {"amx_bf16", "avx512_bf16"})
    return False


def resolve_device(device: str) -> str:
    """"auto" -> "cuda" when a CUDA device is usable, else "cpu"; others unchanged."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str, device: str) -> str:
    """"auto" -> bfloat16 on CUDA or on CPUs with native bf16, else float32."""
    if dtype != "auto":
        return dtype
    if device.startswith("cuda") or cpu_has_native_bf16():
        return "bfloat16"
    return "float32"


def resolve_backend(backend: str, device: str) -> str:
    """"auto" -> "triton" on CUDA, "torch" on CPU."""
    if backend != "auto":
        return backend
    return "triton" if device.startswith("cuda") else "torch"
