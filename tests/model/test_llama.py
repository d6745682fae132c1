"""The Llama-family model against transformers on tiny random checkpoints (CPU, seconds).

Each variant (tied/untied embeddings, GQA/MQA/MHA, Qwen2 qkv bias, Llama attention bias,
llama3 and linear rope scaling, Mistral, Qwen3's per-head q/k norms, OLMo 2's norms after the
sublayers and q/k norms over all heads, Granite's multipliers, Qwen3-MoE's experts beside a
dense layer and without renormalised weights, Mixtral, Phi-3's fused projections and partial rotary) is written to a temp dir by tinymodel.py and
loaded both by kvserve and by transformers; logits of a ragged batch through the paged KV
cache and the torch attention backend must match transformers' per-prompt forward.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.kernels import get_backend
from kvserve.model.blocks import RMSNorm, apply_rotary
from kvserve.model.config import config_from_hf
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.weights import load_weights

from .tinymodel import PagedKV, greedy_generate, tiny_config, write_tiny_model

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
VARIANTS = {
    "llama-tied-gqa": {},
    "llama-untied-mha-attn-bias": {"tie": False, "num_kv_heads": 4, "attention_bias": True},
    "llama-mqa-linear-rope": {
        "num_kv_heads": 1,
        "rope_scaling": {"rope_type": "linear", "factor": 4.0},
    },
    "llama3-rope": {"rope_scaling": LLAMA3},
    "qwen2-qkv-bias": {"family": "qwen2"},
    "mistral-untied": {"family": "mistral", "tie": False},
    "qwen3-qk-norm": {"family": "qwen3", "tie": False},
    "olmo2-norms-after": {"family": "olmo2", "tie": False, "num_kv_heads": 4},
    "qwen3-moe": {"family": "qwen3_moe", "extra": {"num_experts": 6, "num_experts_per_tok": 2,
                                                   "moe_intermediate_size": 24, "mlp_only_layers": [0],
                                                   "norm_topk_prob": True}},
    "phi3-fused": {"family": "phi3", "tie": False},
    "phi3-partial-rotary": {"family": "phi3", "extra": {"partial_rotary_factor": 0.5}},
    "mixtral": {"family": "mixtral", "extra": {"num_local_experts": 4, "num_experts_per_tok": 2}},
    "qwen3-moe-unnormalised": {"family": "qwen3_moe", "tie": False, "extra": {
        "num_experts": 4, "num_experts_per_tok": 3, "moe_intermediate_size": 32, "norm_topk_prob": False}},
    "granite-multipliers": {"family": "granite", "extra": {
        "embedding_multiplier": 3.0, "residual_multiplier": 0.4, "attention_multiplier": 0.1, "logits_scaling": 2.5}},
}
PROMPTS = [[5, 17, 99, 3, 200, 41, 7], [12, 250], list(range(30, 130, 3))]


@pytest.fixture(scope="module")
def backend():
    return get_backend("torch")


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory) -> tuple[str, LlamaForCausalLM, torch.nn.Module]:
    """(name, kvserve model, transformers model) loaded from the same tiny directory."""
    from transformers import AutoModelForCausalLM

    name = request.param
    path = write_tiny_model(tmp_path_factory.mktemp(name), seed=len(name), **VARIANTS[name])
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return name, load_weights(path), hf


def test_ragged_logits_match_transformers(variant, backend) -> None:
    name, model, hf = variant
    kv = PagedKV(model.config, max_reqs=4, max_len=64, dtype=torch.float32)
    # Rows out of order and a gap, so row/slot bookkeeping is exercised too.
    logits = kv.forward(
        model, backend, PROMPTS, rows=[2, 0, 3], prefix_lens=[0, 0, 0], all_logits=True
    )
    ref = []
    with torch.no_grad():
        for p in PROMPTS:
            ref.append(hf(torch.tensor([p])).logits[0])
    ref_all = torch.cat(ref)
    err = (logits - ref_all).abs().max().item()
    assert logits.dtype == torch.float32 and logits.shape == ref_all.shape
    assert err < 1e-4, f"{name}: max abs logit error {err}"


def test_greedy_decode_matches_transformers(variant, backend) -> None:
    """Batched prefill + decode through the paged cache is HF's greedy continuation.

    Teacher forcing: one HF forward over prompt + our tokens must have our next token as
    the argmax at every step (exactly the condition for HF greedy to produce it).
    """
    name, model, hf = variant
    ours = greedy_generate(model, backend, PROMPTS, 10, dtype=torch.float32)
    for prompt, got in zip(PROMPTS, ours, strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + got])).logits[0]
        hf_next = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
        assert got == hf_next, name


def test_chunked_prefill_equals_one_shot(tmp_path, backend) -> None:
    model = load_weights(write_tiny_model(tmp_path / "m", tie=False))
    prompt = PROMPTS[2]
    kv1 = PagedKV(model.config, max_reqs=1, max_len=64, dtype=torch.float32)
    one = kv1.forward(model, backend, [prompt], rows=[0], prefix_lens=[0])
    kv2 = PagedKV(model.config, max_reqs=1, max_len=64, dtype=torch.float32)
    kv2.forward(model, backend, [prompt[:13]], rows=[0], prefix_lens=[0])
    kv2.forward(model, backend, [prompt[13:21]], rows=[0], prefix_lens=[13])
    rest = kv2.forward(model, backend, [prompt[21:]], rows=[0], prefix_lens=[21])
    torch.testing.assert_close(rest, one, atol=1e-5, rtol=1e-5)


def test_bfloat16_forward_runs_and_tracks_float32(tmp_path, backend) -> None:
    path = write_tiny_model(tmp_path / "m")
    f32 = load_weights(path, dtype=torch.float32)
    bf16 = load_weights(path, dtype=torch.bfloat16)
    assert bf16.layers[0].qkv_weight.dtype == torch.bfloat16
    a = PagedKV(f32.config, max_reqs=3, max_len=64, dtype=torch.float32)
    b = PagedKV(bf16.config, max_reqs=3, max_len=64, dtype=torch.bfloat16)
    la = a.forward(f32, backend, PROMPTS, rows=[0, 1, 2], prefix_lens=[0, 0, 0])
    lb = b.forward(bf16, backend, PROMPTS, rows=[0, 1, 2], prefix_lens=[0, 0, 0])
    assert lb.dtype == torch.float32
    assert b.k_buffer.abs().sum() > 0
    rel = ((la - lb).norm() / la.norm()).item()
    assert rel < 0.05, rel


def test_rms_norm_formula() -> None:
    norm = RMSNorm(8, 1e-6, dtype=torch.float32, device=torch.device("cpu"))
    norm.weight.data.copy_(torch.linspace(0.5, 2.0, 8))
    x = torch.randn(3, 8)
    want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), want)


def test_apply_rotary_matches_transformers() -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cfg = config_from_hf(tiny_config().to_dict(), "tiny")
    pos = torch.tensor([0, 1, 5, 77])
    freqs = pos[:, None].float() * cfg.inv_freq()[None, :]
    x = torch.randn(4, 3, cfg.head_dim)
    emb = torch.cat([freqs, freqs], -1)
    ref, _ = apply_rotary_pos_emb(
        x.transpose(0, 1)[None], x.transpose(0, 1)[None], emb.cos()[None], emb.sin()[None]
    )
    got = apply_rotary(x, freqs.cos()[:, None], freqs.sin()[:, None])
    torch.testing.assert_close(got, ref[0].transpose(0, 1))


@pytest.mark.parametrize("rope", [None, LLAMA3, {"rope_type": "linear", "factor": 4.0}])
def test_inv_freq_matches_transformers(rope) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = tiny_config(rope_scaling=rope, head_dim=32)
    cfg = config_from_hf(hf_cfg.to_dict(), "tiny")
    if rope is None:
        theta = cfg.rope_theta
        want = 1.0 / theta ** (torch.arange(0, 32, 2).float() / 32)
    else:
        want, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_cfg, "cpu")
    torch.testing.assert_close(cfg.inv_freq(), want.float())
    assert not math.isnan(cfg.inv_freq().sum().item())


def test_static_loop_matches_paged_greedy(tmp_path, backend) -> None:
    """The benchmark baseline (dense contiguous cache) computes the same greedy tokens."""
    from kvserve.tools.staticloop import static_generate

    model = load_weights(write_tiny_model(tmp_path / "m", num_kv_heads=2))
    prompts = [PROMPTS[2][:9], PROMPTS[2][5:14], PROMPTS[2][20:29]]
    run = static_generate(model, torch.tensor(prompts), 8)
    want = greedy_generate(model, backend, prompts, 8, dtype=torch.float32)
    assert run.tokens.tolist() == want
    assert run.tokens_per_s > 0 and run.decode_tokens_per_s > 0


@pytest.mark.parametrize("family", ["qwen3", "olmo2"])
def test_bfloat16_logits_equal_transformers_bitwise(tmp_path, backend, family) -> None:
    # OLMo 2 scales its norms and turns its rotary in float32 before rounding (float_tail)
    from transformers import AutoModelForCausalLM

    path = write_tiny_model(tmp_path / "m", family=family, tie=False)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    model = load_weights(path, dtype=torch.bfloat16)
    kv = PagedKV(model.config, max_reqs=1, max_len=64, dtype=torch.bfloat16)
    ours = kv.forward(model, backend, [PROMPTS[0]], rows=[0], prefix_lens=[0], all_logits=True)  # bf16's, as float32
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS[0]])).logits[0].float()
    assert torch.equal(ours, ref), (ours - ref).abs().max()
