"""`kvserve serve --config FILE` hands the file's [memsvc], [runner] and [frontend] tables to
real child processes, with [serve] keys over the children's tables.

One `kvserve serve` on the tiny model (tests/model/tinymodel.py), started for the module
through the faults harness; each test reads one table's value back from the process it
configures (metrics, a refused request, a step count).
"""

from __future__ import annotations

import math
import re
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from kvserve.v1 import generator_pb2 as pb
from tests.faults.harness import Service, start_serve, stop_serve
from tests.model.tinymodel import write_tiny_model

pytestmark = pytest.mark.timeout(300)

KV_TOKENS = 1000
CHUNK = 4
CONFIG = f"""
[memsvc]
kv_tokens = {KV_TOKENS}
policy = "reserve"

[runner]
chunk_size = {CHUNK}

[frontend]
max_stop_strings = 1

[serve]
policy = "optimistic"
"""


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    base = tmp_path_factory.mktemp("serve-config")
    model = write_tiny_model(base / "tiny")
    config = base / "kvserve.toml"
    config.write_text(CONFIG)
    svc = start_serve(base / "rt", model, "--config", str(config))
    yield svc
    assert stop_serve(svc) == 0


def _metrics_text(service: Service, offset: int) -> str:
    url = f"http://127.0.0.1:{service.metrics_base + offset}/metrics"
    return urllib.request.urlopen(url, timeout=5).read().decode()


def test_memsvc_table_sizes_the_pool(service: Service) -> None:
    # every slot but the reserved page 0 is free, held by a request or cached
    assert service.metric(1, "kvserve_kv_cache_slots") == KV_TOKENS
    assert service.stats().slots_total == KV_TOKENS


def test_serve_table_wins_over_the_memsvc_table(service: Service) -> None:
    assert service.stats().policy == "optimistic"
    info = re.search(r"^kvserve_runner_info\{(.*)\} 1\.0$", _metrics_text(service, 2), re.M)
    assert info is not None and 'policy="optimistic"' in info.group(1)


def test_frontend_table_limits_stop_strings(service: Service) -> None:
    two = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_new_tokens=2, stop=["a", "b"]))
    with pytest.raises(grpc.RpcError) as info:
        list(service.stub.Generate(two, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("sampling.stop: too many stop strings: 2 > 1")
    one = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_new_tokens=2, stop=["a"]))
    assert list(service.stub.Generate(one, timeout=60))[-1].finish_reason in ("stop", "length")


def test_runner_table_sets_the_prefill_chunk(service: Service) -> None:
    prefill = 'kvserve_runner_step_seconds_count{phase="prefill"}'
    before = service.metric(2, prefill)
    prompt = list(range(40, 62))  # 22 tokens no earlier request began with: no prefix hit
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                             sampling=pb.SamplingParams(max_new_tokens=1, ignore_eos=True))
    out = list(service.stub.Generate(req, timeout=60))
    assert out[-1].usage.prompt_tokens == len(prompt)
    assert service.metric(2, prefill) - before == math.ceil(len(prompt) / CHUNK)
