"""`kvserve serve` on the embedded default model (a Q4_1 GGUF) with its default
`--quantization auto`: the runner serves it through torch's int4 CPU kernel (its info metric
says so) and a greedy chat still knows the capital of France."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest

from kvserve.v1 import generator_pb2 as pb
from tests.faults.harness import start_serve, stop_serve

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def test_default_serve_runs_the_q4_1_file_int4_answers_and_says_so(tmp_path: Path) -> None:
    svc = start_serve(tmp_path / "rt", None, "--kv-tokens", "4096", ready_s=300.0)
    try:
        info = urllib.request.urlopen(f"http://127.0.0.1:{svc.metrics_base + 2}/metrics", timeout=5).read().decode()
        assert re.search(r'^kvserve_runner_info\{[^}]*quantization="int4"', info, re.M), info[:2000]
        req = pb.GenerateRequest(
            chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="What is the capital of France?")]),
            sampling=pb.SamplingParams(max_new_tokens=16, temperature=0))
        text = "".join(m.text for m in svc.stub.Generate(req, timeout=300))
        assert "Paris" in text, text
    finally:
        assert stop_serve(svc) == 0
