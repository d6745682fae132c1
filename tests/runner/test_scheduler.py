"""Scheduler tests: the tiny model on CPU against a real `kvserve memsvc` process.

Every equivalence is exact (token ids equal): concurrent vs one at a time, prefix hit vs
cold, chunked vs one-shot prefill, preempted vs undisturbed, seeded sampling alone vs in a
batch. The tiny model is "sharpened" (see runner_procs) so its output depends on context.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve.kernels import get_backend
from kvserve.messages.frontend_runner import GenerateReq, SamplingParams
from kvserve.runner.metrics import RunnerMetrics
from kvserve.runner.scheduler import Scheduler, SchedulerConfig

from .runner_procs import (
    attached,
    greedy,
    load_sharp_tiny,
    memsvc_args,
    memsvc_process,
    random_prompts,
    run_all,
    tokens_of,
)
from .test_sampling import _penalized_by_hand

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_sharp_tiny(tmp_path_factory)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("run")
    path.chmod(0o700)
    return path


@pytest.fixture(scope="module")
def roomy(tiny: Any, run_dir: Path) -> Any:
    """A memsvc with room for everything (optimistic, page size 16)."""
    with memsvc_process(run_dir, memsvc_args(tiny.config), name="roomy") as address:
        yield address


class CountingMem:
    """Wraps a MemClient to count step round trips."""

    def __init__(self, client: Any) -> None:
        self.client, self.calls = client, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def step(self, **kw: Any) -> Any:
        self.calls += 1
        return self.client.step(**kw)


class Tapped:
    """The tiny model with the logits of every forward recorded, and set to NaN in the rows
    whose token sits at one of the `poison` positions."""

    def __init__(self, model: Any, poison: frozenset[int] = frozenset()) -> None:
        self.model, self.config, self.device, self.poison = model, model.config, model.device, poison
        self.logits: list[torch.Tensor] = []

    def forward(self, input_ids: torch.Tensor, meta: Any, **kw: Any) -> torch.Tensor:
        logits = self.model.forward(input_ids, meta, **kw)
        if self.poison:
            logits = logits.clone()
            positions = meta.positions[kw["logits_indices"]]
            logits[torch.isin(positions, torch.tensor(sorted(self.poison)))] = float("nan")
        self.logits.append(logits.clone())
        return logits


def make(tiny: Any, client: Any, *, model: Any = None, metrics: Any = None, **kw: Any) -> Scheduler:
    return Scheduler(model=model or tiny.model, mem=client, layout=client.layout, backend=get_backend("torch"),
                     eos_token_ids=tiny.eos_token_ids, config=SchedulerConfig(**kw), metrics=metrics)


def reqs(prompts: list[list[int]], params: SamplingParams, tag: str = "") -> list[GenerateReq]:
    return [GenerateReq(f"{tag}{i}", p, params) for i, p in enumerate(prompts)]


def test_concurrent_equals_one_at_a_time_and_chunked(tiny: Any, roomy: str) -> None:
    prompts = random_prompts(1, [5, 17, 40, 70, 9])
    params = greedy(16)
    with attached(roomy, tiny.config) as client:
        mem = CountingMem(client)
        outs = run_all(make(tiny, mem), reqs(prompts, params, "c"))  # cold: distinct prompts
        calls = mem.calls
        together = tokens_of(outs)
        one = {}  # these hit the prompts' prefixes cached by the batched run
        for r in reqs(prompts, params, "s"):
            one.update(tokens_of(run_all(make(tiny, mem), [r])))
        chunked = tokens_of(run_all(make(tiny, mem, chunk_size=7, max_batch_tokens=20), reqs(prompts, params, "k")))
    assert all(len(v) == 16 for v in one.values())
    assert len({tuple(v) for v in one.values()}) == len(prompts)  # output depends on the prompt
    assert max(len(set(v)) for v in one.values()) > 5  # not one repeated token
    for i in range(len(prompts)):
        assert together[f"c{i}"] == one[f"s{i}"], f"prompt {i}: batched differs from alone"
        assert chunked[f"k{i}"] == one[f"s{i}"], f"prompt {i}: chunked prefill differs"
    # one memsvc message per step at most, and decode steps mostly need none
    assert calls < 16 / 2
    last = {request_id: lst[-1] for request_id, lst in outs.items()}
    assert all(o.finish_reason == "length" for o in last.values())
    assert all(sum(len(o.token_ids) for o in lst) == 16 for lst in outs.values())
    assert all(lst[0].cached_tokens == 0 and lst[0].queue_time >= 0 for lst in outs.values())


def test_prefix_hit_equals_cold(tiny: Any, roomy: str) -> None:
    system = random_prompts(2, [48])[0]
    prompts = [system + tail for tail in random_prompts(3, [5, 11, 20])]
    with attached(roomy, tiny.config) as client:
        # admitted in one step, so none can hit what another commits: all three are cold
        cold = run_all(make(tiny, client), reqs(prompts, greedy(), "c"))
        warm = run_all(make(tiny, client), reqs(prompts, greedy(), "w"))
        rechunked = run_all(make(tiny, client, chunk_size=5), reqs(prompts, greedy(), "k"))
    for i in range(3):
        assert cold[f"c{i}"][0].cached_tokens == 0
        # the whole page-aligned prompt (less its last token) comes from the cache
        assert warm[f"w{i}"][0].cached_tokens == (len(prompts[i]) - 1) // 16 * 16 >= 48
        assert tokens_of(warm)[f"w{i}"] == tokens_of(cold)[f"c{i}"], f"prompt {i}: hit differs from cold"
        assert tokens_of(rechunked)[f"k{i}"] == tokens_of(cold)[f"c{i}"]


@pytest.mark.parametrize("params", [
    greedy(max_new=32),
    # a seeded request draws for its n-th output token from (seed, n): the same after a recompute
    SamplingParams(temperature=0.9, top_k=40, seed=77, max_new_tokens=32, ignore_eos=True),
], ids=["greedy", "seeded"])
def test_preempted_requests_match_undisturbed(tiny: Any, roomy: str, run_dir: Path,
                                              params: SamplingParams) -> None:
    prompts = random_prompts(4, [30, 25, 40, 35, 20, 28])
    with attached(roomy, tiny.config) as client:
        calm = tokens_of(run_all(make(tiny, client), reqs(prompts, params)))
    # 6 requests of up to 72 tokens in a 256-token pool: growth must preempt
    with memsvc_process(run_dir, memsvc_args(tiny.config, kv_tokens=256, grow_chunk=16),
                        name="small") as small:
        with attached(small, tiny.config) as client:
            sched = make(tiny, client)
            outs = run_all(sched, reqs(prompts, params))
            stats = client.stats()
    assert sched.num_preemptions > 0
    assert tokens_of(outs) == calm
    assert stats.slots_request == 0 and stats.rows_used == 0


def test_reserve_policy_waits_instead_of_preempting(tiny: Any, roomy: str, run_dir: Path) -> None:
    prompts = random_prompts(5, [60, 50, 70])
    params = greedy(max_new=30)
    with attached(roomy, tiny.config) as client:
        alone = tokens_of(run_all(make(tiny, client), reqs(prompts, params)))
    with memsvc_process(run_dir, memsvc_args(tiny.config, kv_tokens=256, policy="reserve"),
                        name="reserve") as address:
        with attached(address, tiny.config) as client:
            sched = make(tiny, client)
            for r in reqs(prompts, params):
                sched.add(r)
            first = sched.step()
            assert sched.num_running < 3 and sched.num_waiting > 0  # the pool holds two at most
            rest = run_all(sched, [])
    assert sched.num_preemptions == 0
    for o in first:
        rest[o.request_id].insert(0, o)
    assert tokens_of(rest) == alone


def test_seeded_sampling_reproducible_across_batches(tiny: Any, roomy: str) -> None:
    prompt = random_prompts(6, [12])[0]
    seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_new_tokens=20, ignore_eos=True)
    others = [GenerateReq(f"o{i}", p, SamplingParams(temperature=1.0, max_new_tokens=15, ignore_eos=True))
              for i, p in enumerate(random_prompts(7, [8, 30, 19]))]
    with attached(roomy, tiny.config) as client:
        alone = tokens_of(run_all(make(tiny, client), [GenerateReq("s", prompt, seeded)]))["s"]
        again = tokens_of(run_all(make(tiny, client, seed=9), [GenerateReq("s", prompt, seeded)]))["s"]
        crowd = tokens_of(run_all(make(tiny, client, seed=5), [*others[:2], GenerateReq("s", prompt, seeded), others[2]]))
        other_seed = tokens_of(run_all(make(tiny, client), [GenerateReq("s", prompt, SamplingParams(
            temperature=0.8, top_p=0.9, top_k=50, seed=99, max_new_tokens=20, ignore_eos=True))]))["s"]
    assert alone == again == crowd["s"]
    assert other_seed != alone
    assert len(crowd) == 4


def test_abort_frees_kv_within_one_step(tiny: Any, roomy: str) -> None:
    prompts = random_prompts(8, [20, 30, 200])
    with attached(roomy, tiny.config, name="abort-test") as client:
        sched = make(tiny, client, chunk_size=32)
        for r in reqs(prompts, greedy(max_new=100)):
            sched.add(r)
        for _ in range(3):
            sched.step()
        assert sched.num_running == 3
        sched.abort("0")
        sched.abort("2")  # still in chunked prefill
        sched.abort("nope")
        outs = sched.step()
        by_rid = {o.request_id: o for o in outs}
        assert by_rid["0"].finish_reason == "abort" and by_rid["2"].finish_reason == "abort"
        assert sched.num_running == 1
        sched.abort("1")
        outs = sched.step()
        assert [o.finish_reason for o in outs] == ["abort"]
        assert not sched.has_work()
        stats = client.stats()
    assert stats.slots_request == 0 and stats.rows_used == 0


def test_stop_ids_eos_length_and_bad_input(tiny: Any, roomy: str) -> None:
    prompt = random_prompts(9, [10])[0]
    with attached(roomy, tiny.config) as client:
        base = tokens_of(run_all(make(tiny, client), [GenerateReq("b", prompt, greedy(max_new=12))]))["b"]
        stop_at = base[5]
        first = base.index(stop_at)
        outs = run_all(make(tiny, client), [
            GenerateReq("stop", prompt, greedy(max_new=12, stop_token_ids=[stop_at])),
            GenerateReq("eos", prompt, SamplingParams(max_new_tokens=12)),
            GenerateReq("long", random_prompts(10, [500])[0], greedy(max_new=50)),
            GenerateReq("empty", [], greedy()),
            GenerateReq("range", [1, 2, 10**6], greedy()),
            GenerateReq("huge", list(range(200)) * 3, greedy()),
        ])
    assert tokens_of(outs)["stop"] == base[: first + 1]
    assert outs["stop"][-1].finish_reason == "stop"
    eos = set(tiny.eos_token_ids)
    got = tokens_of(outs)["eos"]
    if eos & set(base):
        assert got[-1] in eos and outs["eos"][-1].finish_reason == "stop"
    else:
        assert got == base
    assert len(tokens_of(outs)["long"]) == 512 - 500  # the context length ends it
    assert outs["long"][-1].finish_reason == "length"
    for request_id, field in (("empty", "token_ids"), ("range", "token_ids"), ("huge", "token_ids")):
        assert outs[request_id][-1].finish_reason == "error" and field in outs[request_id][-1].error
        assert outs[request_id][-1].error_code == "INVALID_ARGUMENT"


def test_logprobs_flow_through(tiny: Any, roomy: str) -> None:
    prompt = random_prompts(11, [15])[0]
    tap = Tapped(tiny.model)
    with attached(roomy, tiny.config) as client:
        outs = run_all(make(tiny, client, model=tap), [GenerateReq("lp", prompt, greedy(max_new=6, logprobs=3))])
    lps = [lp for o in outs["lp"] for lp in o.logprobs]
    assert len(lps) == len(tap.logits) == 6
    for tok, lp, logits in zip(tokens_of(outs)["lp"], lps, tap.logits, strict=True):
        ref = torch.log_softmax(logits[0], -1)
        top = ref.topk(3)
        assert lp.top_ids[0] == tok and lp.top_ids == top.indices.tolist()
        assert lp.logprob == pytest.approx(float(ref[tok]))
        assert lp.top_logprobs == pytest.approx(top.values.tolist())


def test_penalties_follow_the_formulas_step_by_step(tiny: Any, roomy: str) -> None:
    """Each greedy token is the argmax of that step's logits penalized by hand from the
    prompt and the tokens before it (the scheduler's counts and the sampler's math)."""
    prompt = random_prompts(12, [15])[0]
    rep, presence, frequency = 1.3, 0.4, 0.3
    params = greedy(max_new=20, repetition_penalty=rep, presence_penalty=presence, frequency_penalty=frequency)
    tap = Tapped(tiny.model)
    with attached(roomy, tiny.config) as client:
        got = tokens_of(run_all(make(tiny, client, model=tap), [GenerateReq("pen", prompt, params)]))["pen"]
    assert len(got) == len(tap.logits) == 20  # one sampled row per forward
    changed = 0
    for step, logits in enumerate(tap.logits):
        raw = logits[0].tolist()
        by_hand = _penalized_by_hand(raw, set(prompt), Counter(got[:step]), rep, presence, frequency)
        want = max(range(len(raw)), key=by_hand.__getitem__)
        assert got[step] == want, f"step {step}"
        changed += want != max(range(len(raw)), key=raw.__getitem__)
    assert changed >= 3  # the penalties decided several tokens


def test_nonfinite_logits_fail_only_their_request_as_internal(tiny: Any, roomy: str) -> None:
    """NaN logits at a request's prefill (position 39 of a 40-token prompt) or in its decode
    (position 52 of a 50-token one) fail that request with INTERNAL, counted; the others
    in the batch go on as if alone, and nothing of a failed prefill is cached."""
    others = random_prompts(13, [20, 33, 18])  # their positions stay below 39
    at_prefill, in_decode = random_prompts(14, [40, 50])
    tap = Tapped(tiny.model, poison=frozenset({39, 52}))
    metrics = RunnerMetrics()
    with attached(roomy, tiny.config) as client:
        clean = tokens_of(run_all(make(tiny, client), reqs(others, greedy(4), "c")))
        outs = run_all(make(tiny, client, model=tap, metrics=metrics), [
            *reqs(others, greedy(4), "o"), GenerateReq("pre", at_prefill, greedy(8)),
            GenerateReq("dec", in_decode, greedy(8)),
        ])
        again = run_all(make(tiny, client), [GenerateReq("again", at_prefill + [5], greedy(2))])
        stats = client.stats()
    assert outs["pre"] == [outs["pre"][0]] and outs["pre"][0].token_ids == []
    assert len(tokens_of(outs)["dec"]) == 3  # positions 49, 50, 51 sampled; 52 is NaN
    for last in (outs["pre"][-1], outs["dec"][-1]):
        assert last.finish_reason == "error" and last.error_code == "INTERNAL" and "non-finite" in last.error
    for i in range(3):
        assert tokens_of(outs)[f"o{i}"] == clean[f"c{i}"]
    assert metrics.registry.get_sample_value("kvserve_runner_nonfinite_logits_total") == 2.0
    assert again["again"][0].cached_tokens == 0  # the NaN request's prompt never entered the cache
    assert stats.slots_request == 0 and stats.rows_used == 0


def test_tiny_temperature_is_greedy_and_unseeded_sampling_is_fresh(tiny: Any, roomy: str) -> None:
    prompt = random_prompts(15, [12])[0]
    tiny_t = SamplingParams(temperature=1e-40, top_p=0.9, seed=3, max_new_tokens=16, ignore_eos=True)
    hot = SamplingParams(temperature=100.0, max_new_tokens=24, ignore_eos=True)
    with attached(roomy, tiny.config) as client:
        out = tokens_of(run_all(make(tiny, client), [GenerateReq("g", prompt, greedy(16)),
                                                     GenerateReq("t", prompt, tiny_t)]))
        # two runners with the default seed (0: fresh entropy), then two with --seed 7
        fresh = [tokens_of(run_all(make(tiny, client), [GenerateReq("u", prompt, hot)]))["u"] for _ in range(2)]
        fixed = [tokens_of(run_all(make(tiny, client, seed=7), [GenerateReq("u", prompt, hot)]))["u"]
                 for _ in range(2)]
    assert out["t"] == out["g"] and len(set(out["g"])) > 1  # not token 0 forever
    assert fresh[0] != fresh[1]
    assert fixed[0] == fixed[1]


class StalledAfterLastWrite:
    """The tiny model, but the process 'stops' after the last layer's KV write of the
    `at`-th forward, until past the lease: the heartbeat halts and the lease's deadline passes."""

    def __init__(self, model: Any, client: Any, at: int) -> None:
        self.model, self.config, self.device = model, model.config, model.device
        self.client, self.at, self.calls = client, at, 0

    def forward(self, input_ids: torch.Tensor, meta: Any, **kw: Any) -> torch.Tensor:
        logits = self.model.forward(input_ids, meta, **kw)
        self.calls += 1
        if self.calls == self.at:
            self.client._stop_heartbeat()
            self.client.valid_until = time.monotonic() - 0.01
        return logits


def test_step_whose_lease_ran_out_after_the_last_write_emits_nothing(tiny: Any, roomy: str) -> None:
    """A lease that ran out during a step (after the last layer's write, so no write fence
    tripped) may have let attention read reused slots: the step raises LeaseExpired, emits
    no token and advances no request; the steps before it emitted theirs."""
    from kvserve.memsvc.client import LeaseExpired

    prompts = random_prompts(15, [12, 21])
    with attached(roomy, tiny.config) as client:
        model = StalledAfterLastWrite(tiny.model, client, at=3)  # prefill, 1 decode, then stalls
        sched = make(tiny, client, model=model)
        for r in reqs(prompts, greedy(8), "s"):
            sched.add(r)
        emitted = [o for _ in range(2) for o in sched.step()]
        before = [(r.computed, len(r.tokens)) for r in sched.table]
        with pytest.raises(LeaseExpired, match="lease ran out"):
            sched.step()
        assert [(r.computed, len(r.tokens)) for r in sched.table] == before
        assert [len(r.tokens) for r in sched.table] == [len(p) + 2 for p in prompts]
    assert sorted(o.request_id for o in emitted) == ["s0", "s0", "s1", "s1"]
    assert client.lease_lost
