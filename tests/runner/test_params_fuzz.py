"""Property test of the runner's request checks (issue 15): `Scheduler.add` takes any
`SamplingParams` (floats with nan and inf, ints far past 64 bits, long lists). A request
with a bad field fails with an error naming a field that is bad (INVALID_ARGUMENT); any
other request samples, steps after step, without raising, and its tokens and logprobs are
in range. A real Scheduler on the tiny model against a real memsvc process."""

from __future__ import annotations

import itertools
import math
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.kernels import get_backend
from kvserve.messages.frontend_runner import FinishReason, GenerateReq, SamplingParams
from kvserve.runner.checks import MAX_LOGPROBS, MAX_STOP_TOKEN_IDS
from kvserve.runner.scheduler import Scheduler, SchedulerConfig

from .runner_procs import attached, load_sharp_tiny, memsvc_args, memsvc_process

pytestmark = pytest.mark.timeout(300)

STEPS = 3  # steps a valid request runs before it is aborted
IDS = itertools.count()


@pytest.fixture(scope="module")
def sched(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tiny = load_sharp_tiny(tmp_path_factory)
    run_dir = tmp_path_factory.mktemp("fuzz-run")
    run_dir.chmod(0o700)
    with memsvc_process(run_dir, memsvc_args(tiny.config), name="fuzz") as address:
        with attached(address, tiny.config) as client:
            yield Scheduler(model=tiny.model, mem=client, layout=client.layout, backend=get_backend("torch"),
                            eos_token_ids=tiny.eos_token_ids, config=SchedulerConfig())


def bad_fields(p: SamplingParams, arrival: float, vocab: int) -> set[str]:
    """The fields of a request that the runner must refuse, written out independently."""
    bad = set()
    if not (math.isfinite(p.temperature) and p.temperature >= 0):
        bad.add("temperature")
    if not 0 < p.top_p <= 1:
        bad.add("top_p")
    if p.top_k < 0:
        bad.add("top_k")
    if not 0 <= p.min_p <= 1:
        bad.add("min_p")
    if not (math.isfinite(p.repetition_penalty) and p.repetition_penalty > 0):
        bad.add("repetition_penalty")
    for name in ("presence_penalty", "frequency_penalty"):
        if not math.isfinite(getattr(p, name)):
            bad.add(name)
    if p.seed is not None and not -(2**63) <= p.seed < 2**64:
        bad.add("seed")
    if not 1 <= p.max_new_tokens < 2**63:
        bad.add("max_new_tokens")
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(not 0 <= t < vocab for t in p.stop_token_ids):
        bad.add("stop_token_ids")
    if not 0 <= p.logprobs <= MAX_LOGPROBS:
        bad.add("logprobs")
    if not math.isfinite(arrival):
        bad.add("arrival_time")
    return bad


EDGE_FLOATS = [0.0, -0.0, 1e-40, 5e-324, 9.99e-6, 1e-5, 0.5, 1.0, 2.0, -1.0, 1e300, -1e300,
               math.nan, math.inf, -math.inf]
EDGE_INTS = [0, 1, -1, 20, 21, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 10**30]
wild_floats = st.one_of(st.sampled_from(EDGE_FLOATS), st.floats())
wild_ints = st.one_of(st.sampled_from(EDGE_INTS), st.integers(-3, 40), st.integers(-(2**80), 2**80))
wild_lists = st.one_of(st.lists(wild_ints, max_size=6),
                       st.integers(MAX_STOP_TOKEN_IDS - 2, MAX_STOP_TOKEN_IDS + 2).map(lambda n: [1] * n))
wild = st.builds(
    SamplingParams, temperature=wild_floats, top_p=wild_floats, top_k=wild_ints, min_p=wild_floats,
    repetition_penalty=wild_floats, presence_penalty=wild_floats, frequency_penalty=wild_floats,
    seed=st.none() | wild_ints, max_new_tokens=wild_ints, stop_token_ids=wild_lists,
    ignore_eos=st.booleans(), logprobs=wild_ints,
)


def in_range(vocab: int) -> st.SearchStrategy[SamplingParams]:
    """Parameters every field of which is good, edges included."""
    def f(lo: float, hi: float, *edges: float) -> st.SearchStrategy[float]:
        return st.one_of(st.sampled_from(edges), st.floats(lo, hi)) if edges else st.floats(lo, hi)

    return st.builds(
        SamplingParams,
        temperature=f(0.0, 1e308, 0.0, 1e-40, 9.99e-6, 1e-5, 2e-5, 0.7, 1e30),
        top_p=f(1e-300, 1.0, 1.0, 1e-300, 0.5), top_k=st.one_of(st.integers(0, 300), st.integers(0, 2**80)),
        min_p=f(0.0, 1.0, 0.0, 1.0), repetition_penalty=f(5e-324, 1e308, 1.0, 5e-324, 1e308),
        presence_penalty=f(-1e308, 1e308, 0.0, -1e308), frequency_penalty=f(-1e308, 1e308, 0.0, 1e308),
        seed=st.none() | st.integers(-(2**63), 2**64 - 1), max_new_tokens=st.integers(1, 2**63 - 1),
        stop_token_ids=st.lists(st.integers(0, vocab - 1), max_size=8), ignore_eos=st.booleans(),
        logprobs=st.integers(0, MAX_LOGPROBS),
    )


def _run(sched: Scheduler, req: GenerateReq) -> list:
    """Add `req`, run up to STEPS steps, abort it and drain; its outputs."""
    sched.add(req)
    outs = []
    for _ in range(STEPS):
        outs += [o for o in sched.step() if o.request_id == req.request_id]
        if outs and outs[-1].finish_reason:
            break
    sched.abort(req.request_id)
    for _ in range(50):
        if not sched.has_work():
            break
        outs += [o for o in sched.step() if o.request_id == req.request_id]
    assert not sched.has_work(), "the scheduler did not drain"
    return outs


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_params_are_refused_by_name_or_sampled(sched: Scheduler, data: st.DataObject) -> None:
    vocab = sched.vocab_size
    params = data.draw(st.one_of(in_range(vocab), wild), label="params")
    arrival = data.draw(st.one_of(st.just(0.0), wild_floats), label="arrival_time")
    prompt = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=24), label="prompt")
    bad = bad_fields(params, arrival, vocab)
    outs = _run(sched, GenerateReq(f"f{next(IDS)}", prompt, params, arrival_time=arrival))
    assert outs and outs[-1].finish_reason
    if bad:
        assert len(outs) == 1 and outs[0].finish_reason == FinishReason.ERROR and outs[0].token_ids == []
        assert outs[0].error_code == "INVALID_ARGUMENT"
        named = re.match(r"(?:params\.)?(\w+)", outs[0].error)
        assert named is not None and named.group(1) in bad, (outs[0].error, bad)
        return
    assert all(o.finish_reason != FinishReason.ERROR for o in outs), [o.error for o in outs]
    tokens = [t for o in outs for t in o.token_ids]
    assert tokens and all(0 <= t < vocab for t in tokens)
    for o in outs:
        if params.logprobs > 0:
            assert len(o.logprobs) == len(o.token_ids)
            for lp in o.logprobs:
                assert len(lp.top_ids) == params.logprobs and all(0 <= t < vocab for t in lp.top_ids)
                assert math.isfinite(lp.logprob) and lp.logprob <= 0
        else:
            assert o.logprobs == []


def test_each_bad_field_is_named(sched: Scheduler) -> None:
    """One bad field at a time, the error names exactly it."""
    vocab = sched.vocab_size
    cases = {
        "temperature": [math.nan, math.inf, -1e-9], "top_p": [0.0, 1.5, math.nan], "top_k": [-1],
        "min_p": [-0.1, 1.1, math.nan], "repetition_penalty": [0.0, -1.0, math.inf, math.nan],
        "presence_penalty": [math.nan, -math.inf], "frequency_penalty": [math.inf],
        "seed": [2**64, -(2**63) - 1], "max_new_tokens": [0, -5, 2**63],
        "stop_token_ids": [[vocab], [-1], [1] * (MAX_STOP_TOKEN_IDS + 1)], "logprobs": [-1, MAX_LOGPROBS + 1],
    }
    for field, values in cases.items():
        for value in values:
            params = SamplingParams(**{field: value})
            out = _run(sched, GenerateReq(f"b{next(IDS)}", [1, 2, 3], params))
            assert [o.finish_reason for o in out] == ["error"]
            assert out[0].error.startswith(f"params.{field}") and out[0].error_code == "INVALID_ARGUMENT", out[0]
    out = _run(sched, GenerateReq(f"b{next(IDS)}", [1, 2, 3], SamplingParams(), arrival_time=math.nan))
    assert out[0].error.startswith("arrival_time:")
