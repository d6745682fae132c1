"""Helpers of the runner tests: a real `kvserve memsvc` process, a tiny model whose output
depends on its context, and a Scheduler driven to completion.

A randomly initialised tiny Llama repeats one token forever, which would hide KV-cache
mistakes; `write_sharp_tiny_model` scales its projections so that its greedy output
varies with the context (any wrong KV changes the tokens).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from kvserve.memsvc.client import MemClient
from kvserve.messages.frontend_runner import GenerateReq, SamplingParams, TokenOut

from ..faults.harness import stop_process
from ..model.tinymodel import write_tiny_model

SHARPEN = {"self_attn": 4.0, "mlp": 4.0}


def write_sharp_tiny_model(path: Path, **config_kw: Any) -> Path:
    """A tiny random Llama HF directory whose attention and MLP weights are scaled up
    (`config_kw`: `tiny_config`'s, e.g. num_layers)."""
    from safetensors.torch import load_file, save_file

    write_tiny_model(path, **config_kw)
    for file in path.glob("*.safetensors"):
        tensors = load_file(str(file))
        for name, t in tensors.items():
            for part, factor in SHARPEN.items():
                if f".{part}." in name and name.endswith("weight"):
                    tensors[name] = (t * factor).contiguous()
        save_file(tensors, str(file), metadata={"format": "pt"})
    return path


def _written_once(tmp_path_factory: Any, name: str, **config_kw: Any) -> Path:
    """`write_sharp_tiny_model(**config_kw)` at `name` in the session's base temp, once per
    pytest session (shared by test modules and xdist-safe: written aside, then renamed)."""
    path = tmp_path_factory.getbasetemp() / name
    if not (path / "config.json").exists():
        write_sharp_tiny_model(path.with_name(path.name + ".tmp"), **config_kw)
        path.with_name(path.name + ".tmp").rename(path)
    return path


def sharp_tiny_dir(tmp_path_factory: Any) -> Path:
    """The sharpened tiny model, written once per pytest session (shared by test modules)."""
    return _written_once(tmp_path_factory, "runner-sharp-tiny")


INT4_SHAPES = {"hidden_size": 64, "intermediate_size": 128}
"""Tiny shapes the native int4 kernel takes (K a multiple of 64): the default path's kernels."""


def sharp_int4_tiny_dir(tmp_path_factory: Any) -> Path:
    """The sharpened tiny model in `INT4_SHAPES`, written once per pytest session: served with
    `--quantization int4` and serve's own dtype it runs the default model's path (the file's
    4-bit codes on the native kernels, bf16 activations where the CPU has native bf16)."""
    return _written_once(tmp_path_factory, "runner-sharp-int4-tiny", **INT4_SHAPES)


def load_sharp_tiny(tmp_path_factory: Any) -> Any:
    """The sharpened tiny model loaded in fp32 on CPU (a LoadedModel)."""
    import torch

    from kvserve.model.weights import load_model

    return load_model(str(sharp_tiny_dir(tmp_path_factory)), dtype=torch.float32, device="cpu")


def memsvc_args(config: Any, *, kv_tokens: int = 8192, policy: str = "optimistic", page_size: int = 16,
                max_context_len: int = 512, max_reqs: int = 64, grow_chunk: int = 32,
                dtype: str = "float32") -> list[str]:
    return [
        "--n-layers", str(config.num_layers), "--n-kv-heads", str(config.num_kv_heads),
        "--head-dim", str(config.head_dim), "--dtype", dtype, "--kv-tokens", str(kv_tokens),
        "--max-reqs", str(max_reqs), "--max-context-len", str(max_context_len), "--policy", policy,
        "--page-size", str(page_size), "--grow-chunk", str(grow_chunk),
    ]


@contextmanager
def memsvc_process(run_dir: Path, args: list[str], name: str = "memsvc", metrics_port: int = 0) -> Iterator[str]:
    """Run `kvserve memsvc` with `args` until the block ends; yields its address."""
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    address = f"ipc://{run_dir}/{name}.sock"
    env = dict(os.environ, KVSERVE_RUNTIME_DIR=str(run_dir))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve.cli", "memsvc", *args, "--address", address,
         "--metrics-port", str(metrics_port), "--runtime-dir", str(run_dir)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 60
        assert proc.stdout is not None
        line = ""
        while "memsvc ready" not in line:
            line = proc.stdout.readline()
            if (not line and proc.poll() is not None) or time.monotonic() > deadline:
                err = proc.stderr.read() if proc.stderr else ""
                raise RuntimeError(f"memsvc did not start (exit {proc.poll()}): {err[-2000:]}")
        yield address
    finally:
        stop_process(proc)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


@contextmanager
def attached(address: str, config: Any, name: str = "test-runner", dtype: str = "float32") -> Iterator[MemClient]:
    client = MemClient(address, name=name, timeout_s=10.0)
    client.attach(n_layers=config.num_layers, n_kv_heads=config.num_kv_heads,
                  head_dim=config.head_dim, dtype=dtype)
    try:
        yield client
    finally:
        client.close()


def greedy(max_new: int = 24, **kw: Any) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, ignore_eos=True, **kw)


def run_all(sched: Any, reqs: list[GenerateReq], *, max_steps: int = 10000) -> dict[str, list[TokenOut]]:
    """Add `reqs`, step until nothing is left; every TokenOut per request_id."""
    for r in reqs:
        sched.add(r)
    out: dict[str, list[TokenOut]] = {}
    steps = 0
    while sched.has_work():
        for o in sched.step():
            out.setdefault(o.request_id, []).append(o)
        steps += 1
        assert steps < max_steps, "scheduler did not finish"
    return out


def tokens_of(outs: dict[str, list[TokenOut]]) -> dict[str, list[int]]:
    return {request_id: [t for o in lst for t in o.token_ids] for request_id, lst in outs.items()}


def random_prompts(seed: int, lengths: list[int], vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
