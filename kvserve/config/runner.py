"""`RunnerConfig`: the frozen configuration of one runner worker (`kvserve runner`, the
[runner] table, KVSERVE_* variables), and how the attention backend "auto" resolves.

Device and dtype "auto" resolve in kvserve.config.devices (the same functions memsvc
uses). This module knows nothing about sockets, memsvc or the model code.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import ConfigError, option
from kvserve.config.checks import check_at_least, check_port
from kvserve.config.devices import check_device, check_dtype

BACKENDS = ("auto", "torch", "triton")


# the modes kvserve.model.quant implements (a test keeps the two in step)
QUANTIZATIONS = ("auto", "none", "int8", "int4")


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    """Configuration of one runner worker."""

    model: str = option("", help="model: a .gguf file, a Hugging Face directory, or '' for the "
                                 "embedded default")
    device: str = option("auto", help="cpu, cuda, cuda:N or auto (cuda when available)")
    dtype: str = option("auto", help="float32, bfloat16, float16 or auto (bf16 on CUDA or CPUs "
                                     "with AMX/AVX512-BF16, else float32); memsvc's must be the same")
    memsvc_address: str = option("", help="memsvc ZMQ address ('' = ipc://<runtime-dir>/memsvc.sock)")
    frontend_address: str = option("", help="frontend ROUTER address "
                                            "('' = ipc://<runtime-dir>/frontend.sock)")
    curve_secret_key_file: str = option("", help="this runner's CURVE secret key (NAME.key_secret from "
                                                 "`kvserve keygen`, mode 0600) for tcp:// links; its "
                                                 "NAME.key goes into the server's public keys dir")
    memsvc_public_key_file: str = option("", help="memsvc's CURVE public key (NAME.key); with "
                                                  "--curve-secret-key-file, required for a tcp:// "
                                                  "--memsvc-address")
    frontend_public_key_file: str = option("", help="the frontend's CURVE public key (NAME.key); with "
                                                    "--curve-secret-key-file, required for a tcp:// "
                                                    "--frontend-address")
    runner_id: str = option("runner-0", help="identity of this runner on the frontend socket "
                                             "and at memsvc")
    metrics_port: int = option(9402, help="Prometheus metrics port (0 = off)")
    attention_backend: str = option("auto", help="attention backend: torch, triton or auto "
                                                 "(triton on cuda)")
    quantization: str = option("auto", help="weight-only quantization of the projections on CPU: "
                                            "none, int8 (per row), int4 (groups of 32, the grid of a "
                                            "Q4_1 file; the output head is int8 unless none) or auto: "
                                            "int4 for a GGUF of 4-bit weights, int8 for 5-8-bit ones, "
                                            "none for float weights and on CUDA")
    max_running: int = option(256, help="most requests running at once")
    max_batch_tokens: int = option(2048, help="token budget of one scheduler step "
                                              "(prefill chunks + decodes)")
    chunk_size: int = option(512, help="most prompt tokens of one request computed in one step")
    runtime_dir: str = option("", help="directory of ipc sockets ('' = kvserve.paths.runtime_dir())")
    threads: int = option(0, help="torch CPU threads (0 = torch's default)")
    seed: int = option(0, help="seed of the generator unseeded sampled requests share: 0 = fresh "
                               "entropy at start (runners differ); another value repeats their tokens "
                               "run after run. A request's own seed is reproducible whatever this is")
    batch_invariant: str = option("on", help="on: a request's tokens and logits do not depend on what "
                                            "runs beside it (one kernel for every batch size: no "
                                            "switch to the dense bf16 copies); off: those switches, "
                                            "for throughput at large batches")

    def __post_init__(self) -> None:
        check_dtype(self.dtype)
        check_device(self.device)
        if self.attention_backend not in BACKENDS:
            raise ConfigError(f"--attention-backend: {self.attention_backend!r} is not one of "
                              f"{', '.join(BACKENDS)}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"--quantization: {self.quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
        if self.quantization not in ("none", "auto") and self.device.startswith("cuda"):
            raise ConfigError(f"--quantization {self.quantization}: runs on CPU only (--device {self.device})")
        if self.batch_invariant not in ("on", "off"):
            raise ConfigError(f"--batch-invariant: {self.batch_invariant!r} is not one of on, off")
        check_at_least(self, 1, "max_running", "max_batch_tokens", "chunk_size")
        check_at_least(self, 0, "threads")
        check_port("metrics_port", self.metrics_port, allow_zero=True)
        if not self.runner_id or not self.runner_id.isprintable() or len(self.runner_id) > 200:
            raise ConfigError(f"--runner-id: {self.runner_id!r} must be 1-200 printable characters")


def resolve_backend(backend: str, device: str) -> str:
    """"auto" -> "triton" on CUDA, "torch" on CPU (`device` resolved)."""
    if backend != "auto":
        return backend
    return "triton" if device.startswith("cuda") else "torch"
