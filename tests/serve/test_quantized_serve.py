"""`kvserve serve` on the embedded default model (a Q4_1 GGUF) with its default
`--quantization auto`: the runner serves it int4 (its info metric says so), a greedy chat
over gRPC gives, token for token, what the same int4 model gives in this process through the
same attention backend and the same native ops (the 4-bit kernel on 8-bit activations where
the CPU has AVX-512 VNNI, torch's int4 kernel elsewhere), and a prompt longer than one
prefill chunk is served.

Whether int4's greedy answer equals the float model's depends on the CPU's rounding in places
(bench/quant_fidelity.py measures the agreement; README.md has it): this test pins the
serving path to the quantized model it claims to serve, not to the float reference."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest
import torch

from kvserve.kernels import get_backend, native
from kvserve.model.tokenizer import load_model_tokenizer
from kvserve.model.weights import load_model
from kvserve.v1 import generator_pb2 as pb
from tests.faults.harness import start_serve, stop_serve
from tests.model.tinymodel import greedy_generate

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
QUESTION = "What is the capital of France?"
NEW = 16


def test_default_serve_runs_the_q4_1_file_int4_and_equals_the_int4_model(tmp_path: Path) -> None:
    svc = start_serve(tmp_path / "rt", None, "--kv-tokens", "4096", ready_s=300.0)
    try:
        info = urllib.request.urlopen(f"http://127.0.0.1:{svc.metrics_base + 2}/metrics", timeout=5).read().decode()
        labels = re.search(r"^kvserve_runner_info\{([^}]*)\}", info, re.M)
        assert labels, info[:2000]
        label = dict(re.findall(r'(\w+)="([^"]*)"', labels.group(1)))
        assert label["quantization"] == "int4", label
        req = pb.GenerateRequest(
            chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=QUESTION)]),
            sampling=pb.SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True))
        served = [t for m in svc.stub.Generate(req, timeout=300) for t in m.token_ids]
        # a prompt longer than a chunk (512): its first step asks the head for no logits
        long = pb.GenerateRequest(text="Paris is the capital of France. " * 100,
                                  sampling=pb.SamplingParams(max_new_tokens=2, temperature=0))
        msgs = list(svc.stub.Generate(long, timeout=300))
        assert msgs[-1].usage.prompt_tokens > 512 and msgs[-1].usage.completion_tokens == 2
    finally:
        assert stop_serve(svc) == 0

    dtype = getattr(torch, label["dtype"])
    loaded = load_model(None, dtype=dtype, quantization="int4")
    loaded.model.use_row_ops(native)  # as the runner's scheduler does
    tok = load_model_tokenizer(None)
    prompt = tok.render_chat([("user", QUESTION)], add_generation_prompt=True)
    [expected] = greedy_generate(loaded.model, get_backend(label["backend"]), [prompt], NEW, dtype=dtype,
                                 invariant=True)  # serve's default: --batch-invariant on
    assert served == expected, (tok.decode(served), tok.decode(expected))
