"""The runner's frontend socket survives any frame (issue 15, item 1): a hypothesis state
machine feeds `Worker.take_frame` (the runner's per-frame handling, with a real scheduler,
the tiny model and a real memsvc) GenerateReqs with arbitrary sampling parameters and token
ids, aborts of known and unknown ids, and garbage, and runs scheduler steps in between.
Nothing may raise; every request ends with a finish reason, and one that failed names
why; at least 10,000 frames are sent."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from kvserve.config.runner import RunnerConfig
from kvserve.kernels import get_backend
from kvserve.messages.frontend_runner import DOWN, AbortReq, GenerateReq, SamplingParams
from kvserve.runner.metrics import RunnerMetrics
from kvserve.runner.scheduler import Scheduler, SchedulerConfig
from kvserve.runner.worker import Worker
from tests.stateful import drive

from .runner_procs import attached, load_sharp_tiny, memsvc_args, memsvc_process

FRAMES = {"sent": 0}
ENDINGS: Counter = Counter()  # (finish_reason, error_code) of every request that ended
ENV: dict[str, Any] = {}

floats = st.one_of(st.floats(), st.sampled_from([0.0, 1.0, 0.5, 1e-40, -1.0, math.inf, math.nan]))
ints = st.one_of(st.integers(-(2**63), 2**64 - 1), st.integers(-2, 8))
sane = st.builds(
    SamplingParams, temperature=st.sampled_from([0.0, 0.7, 1.0, 1e-40]), top_p=st.sampled_from([1.0, 0.8]),
    top_k=st.integers(0, 5), min_p=st.sampled_from([0.0, 0.1]), repetition_penalty=st.sampled_from([1.0, 1.2]),
    seed=st.one_of(st.none(), st.integers(0, 2**63 - 1)), max_new_tokens=st.integers(1, 4),
    stop_token_ids=st.lists(st.integers(0, 250), max_size=2), ignore_eos=st.booleans(), logprobs=st.integers(0, 2),
)
wild_params = st.builds(
    SamplingParams, temperature=floats, top_p=floats, top_k=ints, min_p=floats, repetition_penalty=floats,
    presence_penalty=floats, frequency_penalty=floats, seed=st.one_of(st.none(), ints),
    max_new_tokens=st.one_of(st.integers(-2, 4), ints), stop_token_ids=st.lists(ints, max_size=4),
    ignore_eos=st.booleans(), logprobs=st.one_of(st.integers(0, 3), ints),
)
params = st.one_of(sane, sane, wild_params)
prompts = st.one_of(st.lists(st.integers(0, 250), min_size=1, max_size=12),
                    st.lists(st.integers(0, 250), min_size=1, max_size=12), st.lists(ints, max_size=4))
garbage = st.one_of(
    st.binary(max_size=48),
    st.dictionaries(st.sampled_from(["type", "request_id", "token_ids", "params"]),
                    st.one_of(st.text(max_size=5), ints, st.lists(ints, max_size=3)), max_size=4).map(msgpack.packb),
)


@pytest.fixture(scope="module", autouse=True)
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    tiny = load_sharp_tiny(tmp_path_factory)
    run_dir: Path = tmp_path_factory.mktemp("fuzzrun")
    run_dir.chmod(0o700)
    with memsvc_process(run_dir, memsvc_args(tiny.config, kv_tokens=2048)) as address, \
            attached(address, tiny.config) as client:
        ENV.update(tiny=tiny, client=client)
        yield
    ENV.clear()


class RunnerMachine(RuleBasedStateMachine):
    @initialize()
    def start(self) -> None:
        tiny, client = ENV["tiny"], ENV["client"]
        self.worker = Worker(RunnerConfig(device="cpu", dtype="float32"))
        self.worker.metrics = RunnerMetrics()
        self.worker.sched = Scheduler(model=tiny.model, mem=client, layout=client.layout,
                                      backend=get_backend("torch"), eos_token_ids=tiny.eos_token_ids,
                                      metrics=self.worker.metrics,
                                      config=SchedulerConfig(max_running=8, max_batch_tokens=64, chunk_size=16))
        self.sent: set[str] = set()
        self.ended: dict[str, str] = {}
        self.n = 0

    def teardown(self) -> None:
        sched = self.worker.sched
        for request_id in list(sched.table.by_rid):
            sched.abort(request_id)
        for _ in range(50):
            if not sched.has_work():
                break
            self._collect(sched.step())
        self.worker._ctx.term()

    def _frame(self, frame: bytes) -> None:
        FRAMES["sent"] += 1
        self.worker.take_frame(frame)

    def _collect(self, outs: list) -> None:
        for out in outs:
            if out.finish_reason:
                assert out.request_id not in self.ended, f"{out.request_id} ended twice"
                self.ended[out.request_id] = out.finish_reason
                ENDINGS[out.finish_reason, out.error_code] += 1
                if out.finish_reason == "error":
                    assert out.error, "a failed request must say why"

    @rule(p=params, prompt=prompts)
    def generate(self, p: SamplingParams, prompt: list[int]) -> None:
        self.n += 1
        request_id = f"g{self.n}"
        self.sent.add(request_id)
        self._frame(DOWN.encode(GenerateReq(request_id=request_id, token_ids=prompt, params=p)))

    @rule(k=st.integers(0, 10**6), known=st.booleans())
    def abort(self, k: int, known: bool) -> None:
        request_id = f"g{k % max(1, self.n) + 1}" if known else f"nobody-{k}"
        self._frame(DOWN.encode(AbortReq(request_id=request_id)))

    @rule(frame=garbage)
    def junk(self, frame: bytes) -> None:
        self._frame(frame)

    @rule(steps=st.integers(1, 3))
    def step(self, steps: int) -> None:
        for _ in range(steps):
            self._collect(self.worker.sched.step())

    @invariant()
    def bounded(self) -> None:
        if hasattr(self, "worker"):
            assert len(self.worker.sched.table.by_rid) <= len(self.sent)
            assert set(self.ended) <= self.sent


def test_runner_survives_ten_thousand_random_frames() -> None:
    drive(RunnerMachine, FRAMES, examples=20, steps=200)
    assert FRAMES["sent"] >= 10_000
    # the fuzz reached both sides: requests that ran to their end, and requests refused by name
    assert ENDINGS["length", ""] + ENDINGS["stop", ""] > 0, ENDINGS
    assert ENDINGS["error", "INVALID_ARGUMENT"] > 0, ENDINGS
