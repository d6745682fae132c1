"""The runner's scheduler driving the Triton backend end to end (interpreter on CPU).

The tiny model generates with attention_backend "triton" exactly as the worker sets it up
on a GPU (a DecodeWorkspace for split-KV decode), against a real memsvc, and must produce
the same greedy tokens as with the torch backend: prefill chunks with and without a cached
prefix, batched decode, and the req_to_token rows memsvc writes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve.kernels import DecodeWorkspace, get_backend
from kvserve.messages.frontend_runner import GenerateReq
from kvserve.runner.scheduler import Scheduler, SchedulerConfig

from ..runner.runner_procs import (
    attached,
    greedy,
    load_sharp_tiny,
    memsvc_args,
    memsvc_process,
    random_prompts,
    run_all,
    tokens_of,
)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_sharp_tiny(tmp_path_factory)


def generate(tiny: Any, client: Any, backend: str, prompts: list[list[int]], tag: str) -> dict:
    mc = tiny.config
    workspace = None
    if backend == "triton":
        workspace = DecodeWorkspace.create(max_batch=8, num_q_heads=mc.num_heads,
                                           head_dim=mc.head_dim, dtype=torch.float32, device="cpu")
    sched = Scheduler(model=tiny.model, mem=client, layout=client.layout,
                      backend=get_backend(backend), eos_token_ids=tiny.eos_token_ids,
                      workspace=workspace, config=SchedulerConfig(chunk_size=24, max_running=8))
    reqs = [GenerateReq(f"{tag}{i}", p, greedy(6)) for i, p in enumerate(prompts)]
    return run_all(sched, reqs)


def test_triton_backend_generates_what_torch_backend_does(tiny: Any, tmp_path: Path) -> None:
    tmp_path.chmod(0o700)
    system = random_prompts(7, [20])[0]
    prompts = [system + tail for tail in random_prompts(8, [3, 30])] + random_prompts(9, [11])
    with memsvc_process(tmp_path, memsvc_args(tiny.config)) as address:
        with attached(address, tiny.config) as client:
            cold = generate(tiny, client, "triton", prompts, "c")  # an empty prefix cache
        with attached(address, tiny.config, name="second") as client:
            expected = generate(tiny, client, "torch", prompts, "t")
            warm = generate(tiny, client, "triton", prompts, "w")  # prompts cached by now
    want = tokens_of(expected)
    for i in range(len(prompts)):
        assert tokens_of(cold)[f"c{i}"] == want[f"t{i}"], f"prompt {i}: triton differs from torch"
        assert tokens_of(warm)[f"w{i}"] == want[f"t{i}"], f"prompt {i}: triton with cache hit differs"
    assert all(lst[0].cached_tokens == 0 for lst in cold.values())
    assert any(lst[0].cached_tokens > 0 for lst in warm.values())  # the prefix path ran
    assert sum(len(v) for v in tokens_of(cold).values()) == 6 * len(prompts)
