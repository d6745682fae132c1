"""The newer families through a real `kvserve serve` (memsvc, runner, frontend), each a tiny random
model written by transformers' own classes: Qwen3 (q/k norms per head), OLMo 2 (norms after the
sublayers), Granite (its multipliers), Qwen3-MoE (experts beside a dense layer), Phi-3 (fused
projections, partial rotary). On the float path (float32, no quantization) a greedy
answer is, token for token, transformers' greedy continuation (teacher forcing: one forward over
prompt + answer has each answer token as its argmax); on the default path (4-bit codes on the
native kernels at serve's dtype, the experts' too) Qwen3's and Qwen3-MoE's answers are the same
int4 model's in this process."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest
import torch

from kvserve.kernels import get_backend, native
from kvserve.model.weights import load_model
from kvserve.v1 import generator_pb2 as pb
from tests.faults.harness import DEFAULT_PATH, start_serve, stop_serve
from tests.model.tinymodel import greedy_generate, write_tiny_model
from tests.runner.runner_procs import INT4_SHAPES

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
PROMPTS = [[5, 17, 99, 3, 200, 41, 7, 250, 12], list(range(30, 130, 3))]
NEW = 12
FAMILIES = {
    "qwen3": {"tie": False},
    "qwen3_moe": {"extra": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                            "norm_topk_prob": True, "mlp_only_layers": [1]}},
    "olmo2": {"num_kv_heads": 4},
    "phi3": {"extra": {"partial_rotary_factor": 0.5}},
    "granite": {"extra": {"embedding_multiplier": 3.0, "residual_multiplier": 0.4, "attention_multiplier": 0.1,
                          "logits_scaling": 2.5}},
}


def _served(model: Path, tmp: Path, *flags: str, dtype: str | None) -> tuple[list[list[int]], dict[str, str]]:
    svc = start_serve(tmp, model, *flags, dtype=dtype)
    try:
        streams = [svc.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=p), sampling=pb.SamplingParams(
            max_new_tokens=NEW, temperature=0, ignore_eos=True)), timeout=120) for p in PROMPTS]  # side by side
        served = [[t for m in s for t in m.token_ids] for s in streams]
        info = urllib.request.urlopen(f"http://127.0.0.1:{svc.metrics_base + 2}/metrics", timeout=5).read().decode()
        labels = re.search(r"^kvserve_runner_info\{([^}]*)\}", info, re.M)
        assert labels, info[:2000]
        return served, dict(re.findall(r'(\w+)="([^"]*)"', labels.group(1)))
    finally:
        assert stop_serve(svc) == 0


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_served_float_is_transformers_greedy(tmp_path: Path, family: str) -> None:
    from transformers import AutoModelForCausalLM

    model = write_tiny_model(tmp_path / "model", family=family, seed=3, **INT4_SHAPES, **FAMILIES[family])
    served, label = _served(model, tmp_path / "rt", "--quantization", "none", dtype="float32")
    assert label["quantization"] == "none"
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    for prompt, got in zip(PROMPTS, served, strict=True):
        assert len(got) == NEW
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + got])).logits[0]
        assert got == logits[len(prompt) - 1 : -1].argmax(-1).tolist(), family


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_qwen3_on_the_default_path_is_the_int4_model(tmp_path: Path, family: str) -> None:
    model = write_tiny_model(tmp_path / "model", family=family, seed=4, **INT4_SHAPES, **FAMILIES[family])
    served, label = _served(model, tmp_path / "rt", *DEFAULT_PATH, dtype=None)
    assert label["quantization"] == "int4"
    dtype = getattr(torch, label["dtype"])
    loaded = load_model(str(model), dtype=dtype, quantization="int4")
    loaded.model.use_row_ops(native)  # as the runner's scheduler does
    expected = greedy_generate(loaded.model, get_backend(label["backend"]), PROMPTS, NEW, dtype=dtype,
                               invariant=True)
    assert served == expected
