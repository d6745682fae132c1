"""Batch invariance (issue 36) on the default path's kernels: a tiny model in bfloat16 with
int4 projections on the native kernels (the embedded model's path: a Q4_1 file's codes on
bf16 activations), against a real `kvserve memsvc` with a host tier.

The property: whatever the batch beside it, the chunk size, the step budget and where its
prefix came from (computed cold, found in the pool, copied back from the host tier), every
request's logits at every output are bitwise those of the request run alone, and its greedy
and seeded tokens the same.
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.kernels import get_backend, native
from kvserve.messages.frontend_runner import GenerateReq, SamplingParams
from kvserve.runner.scheduler import Scheduler, SchedulerConfig

from ..memsvc.conftest import free_port
from .runner_procs import attached, memsvc_args, memsvc_process, sharp_int4_tiny_dir

pytestmark = pytest.mark.timeout(600)
DTYPE = "bfloat16"
KV_TOKENS = 640  # small: three fillers of 200 tokens push a warmed prefix down to the host tier
PAGE = 16


@pytest.fixture(scope="module")
def int4_tiny(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The sharpened tiny model with shapes the native int4 kernel takes (K a multiple of 64),
    loaded as the default path is: bf16, int4 projections, the int8 head."""
    from kvserve.model.weights import load_model

    if not native.int4_available():
        pytest.skip("this CPU's build has no native 4-bit kernel (the default path's)")
    path = sharp_int4_tiny_dir(tmp_path_factory)
    return load_model(str(path), dtype=getattr(torch, DTYPE), device="cpu", quantization="int4")


@pytest.fixture(scope="module")
def tiered(int4_tiny: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """A memsvc with a small pool and a host tier below it: (address, metrics port)."""
    run_dir = tmp_path_factory.mktemp("inv-run")
    run_dir.chmod(0o700)
    port = free_port()
    args = memsvc_args(int4_tiny.config, kv_tokens=KV_TOKENS, dtype=DTYPE, page_size=PAGE) + [
        "--host-cache-bytes", "64MiB"]
    with memsvc_process(run_dir, args, name="tiered", metrics_port=port) as address:
        yield address, port


class Recorder:
    """Each request's logits at each output, taken where the scheduler samples them."""

    def __init__(self, sched: Scheduler, ids: dict[int, str]) -> None:
        self.ids, self.logits = ids, {}
        inner = sched.sampler.sample

        def sample(logits: torch.Tensor, rows: Any, masks: Any = None) -> Any:
            for i, row in enumerate(rows):
                self.logits.setdefault(self.ids[id(row.params)], []).append(logits[i].clone())
            return inner(logits, rows, masks=masks)

        sched.sampler.sample = sample  # type: ignore[method-assign]


def run(model: Any, client: Any, requests: list[GenerateReq], *, join_after: int = 0, joining: int = 0,
        **config: Any) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor]], dict[str, int]]:
    """Run `requests` on a fresh scheduler (the last `joining` of them added `join_after` steps
    in): (tokens, logits per output, cached prompt tokens) per request id."""
    sched = Scheduler(model=model.model, mem=client, layout=client.layout, backend=get_backend("torch"),
                      eos_token_ids=model.eos_token_ids, config=SchedulerConfig(**config))
    rec = Recorder(sched, {id(r.params): r.request_id for r in requests})
    first, later = requests[: len(requests) - joining], requests[len(requests) - joining:]
    for r in first:
        sched.add(r)
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    steps = 0
    while sched.has_work() or later:
        if later and steps >= join_after:
            for r in later:
                sched.add(r)
            later = []
        for o in sched.step():
            assert not o.error, o.error
            tokens.setdefault(o.request_id, []).extend(o.token_ids)
            cached.setdefault(o.request_id, o.cached_tokens)
        steps += 1
        assert steps < 5000
    return tokens, rec.logits, cached


def tier_hit_tokens(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    m = re.search(r'^kvserve_kv_tier_hit_tokens_total\{tier="host"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def params(kind: str, max_new: int, seed: int) -> SamplingParams:
    if kind == "greedy":
        return SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    return SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=seed, max_new_tokens=max_new, ignore_eos=True)


EXAMPLES: list[dict[str, int]] = []  # what each example exercised (read by the last test)

request_st = st.tuples(st.integers(1, 70), st.sampled_from(["cold", "pool", "tier"]),
                       st.sampled_from(["greedy", "seeded"]))


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(requests=st.lists(request_st, min_size=2, max_size=6), chunk=st.sampled_from([3, 7, 16, 33, 512]),
       budget=st.sampled_from([24, 64, 2048]), joining=st.integers(0, 2), join_after=st.integers(0, 4),
       seed=st.integers(0, 2**31 - 1))
def test_a_request_gets_the_same_logits_whatever_runs_beside_it(
        int4_tiny: Any, tiered: tuple[str, int], requests: list[tuple[int, str, str]], chunk: int, budget: int,
        joining: int, join_after: int, seed: int) -> None:
    address, port = tiered
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n, _, _ in requests]
    # a warm prefix: whole pages of the prompt, computed before the batch (the tier's pushed out)
    warm = [p[: max(PAGE, len(p) // PAGE * PAGE)] + torch.randint(0, 256, (3,), generator=g).tolist()
            for p in prompts]
    with attached(address, int4_tiny.config, dtype=DTYPE) as client:
        before = tier_hit_tokens(port)
        for i, (_, state, _) in enumerate(requests):
            if state != "cold":
                run(int4_tiny, client, [GenerateReq(f"w{i}", warm[i], params("greedy", 1, 0))])
        if any(state == "tier" for _, state, _ in requests):
            fillers = [GenerateReq(f"f{i}", torch.randint(0, 256, (200,), generator=g).tolist(),
                                   params("greedy", 1, 0)) for i in range(3)]
            run(int4_tiny, client, fillers)
        batch = [GenerateReq(f"r{i}", p, params(kind, 8, seed + i))
                 for i, (p, (_, _, kind)) in enumerate(zip(prompts, requests, strict=True))]
        tokens, logits, cached = run(int4_tiny, client, batch, join_after=join_after, joining=min(joining, len(batch) - 1),
                                     chunk_size=chunk, max_batch_tokens=max(budget, chunk))
        EXAMPLES.append({"tier_hits": int(tier_hit_tokens(port) - before),
                         "cached": sum(1 for v in cached.values() if v > 0)})
        for r in batch:  # each alone (its whole prompt now cached: a pool hit)
            a_tokens, a_logits, _ = run(int4_tiny, client, [GenerateReq(r.request_id, r.token_ids, r.params)])
            assert tokens[r.request_id] == a_tokens[r.request_id], f"{r.request_id}: tokens differ from alone"
            assert len(logits[r.request_id]) == len(a_logits[r.request_id]) == 8
            for k, (x, y) in enumerate(zip(logits[r.request_id], a_logits[r.request_id], strict=True)):
                assert torch.equal(x, y), f"{r.request_id} output {k}: logits differ from alone " \
                                          f"(max |diff| {(x - y).abs().max().item()})"


def test_the_property_ran_through_cache_hits_from_the_pool_and_the_host_tier() -> None:
    """The examples above did reach the states they name (else the property proved less)."""
    if not EXAMPLES:
        pytest.skip("the property did not run (no native 4-bit kernel)")
    assert sum(e["cached"] for e in EXAMPLES) > 0
    assert sum(e["tier_hits"] for e in EXAMPLES) > 0


def test_batch_invariant_off_keeps_the_switches_whose_numbers_differ(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """The flag's other side (`--batch-invariant off`): the int4 projections and the head keep
    their dense bf16 copies for batches above their rows, whose numbers are other than the
    native kernels'; on (the default) a row's logits are the same bits in a call of any size."""
    from kvserve.model.quant import DENSE_ROWS
    from kvserve.model.weights import load_model

    if not native.int4_available():
        pytest.skip("this CPU's build has no native 4-bit kernel")
    path = sharp_int4_tiny_dir(tmp_path_factory)
    ids = torch.randint(0, 256, (DENSE_ROWS + 8,), generator=torch.Generator().manual_seed(3))
    same = {}
    for invariant in (True, False):
        model = load_model(str(path), dtype=torch.bfloat16, quantization="int4").model
        model.use_row_ops(native, batch_invariant=invariant)
        assert (model.head.dense is None) is invariant
        no_attention = lambda layer, q, k, v: q  # noqa: E731  (rows independent: the projections alone)
        positions = torch.zeros_like(ids)
        every = torch.arange(ids.shape[0])
        many = model.forward_tokens(ids, positions, no_attention, every)
        alone = torch.cat([model.forward_tokens(ids[r: r + 1], positions[:1], no_attention, every[:1])
                           for r in range(ids.shape[0])])
        same[invariant] = torch.equal(many, alone)
    assert same == {True: True, False: False}
