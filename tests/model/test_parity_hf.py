"""Greedy parity with Hugging Face transformers on the embedded default model (SmolLM2 GGUF, fp32).

kvserve loads the GGUF itself (dequantize, un-permute Q/K, fused projections) and runs
through real paged KV buffers with the torch attention backend; transformers loads the
same file with its own GGUF loader. Greedy token ids must be identical, and logits close.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import get_backend
from kvserve.model.files import resolve_model
from kvserve.model.weights import LoadedModel, load_model
from kvserve.tools.parity import PARITY_NEW_TOKENS, PARITY_PROMPTS

from .tinymodel import PagedKV, greedy_generate

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = PARITY_PROMPTS
NEW_TOKENS = PARITY_NEW_TOKENS


@pytest.fixture(scope="module")
def ours() -> LoadedModel:
    return load_model(None, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    path = resolve_model(None)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def prompt_ids(ours: LoadedModel) -> list[list[int]]:
    return [ours.tokenizer(p).input_ids for p in PROMPTS]


def test_default_model_metadata(ours: LoadedModel) -> None:
    assert ours.name == "SmolLM2-135M-Instruct"
    cfg = ours.config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152
    assert ours.eos_token_ids == [2]
    assert ours.tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    assert ours.chat_template and "<|im_start|>" in ours.chat_template


def test_logits_match_transformers(ours: LoadedModel, hf_model, prompt_ids) -> None:
    ids = prompt_ids[2]
    kv = PagedKV(ours.config, max_reqs=1, max_len=len(ids), dtype=torch.float32)
    got = kv.forward(
        ours.model, get_backend("torch"), [ids], rows=[0], prefix_lens=[0], all_logits=True
    )
    with torch.no_grad():
        want = hf_model(torch.tensor([ids])).logits[0]
    err = (got - want).abs().max().item()
    assert err < 2e-3, f"max abs logit error {err}"
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_greedy_tokens_identical_to_transformers_generate(
    ours: LoadedModel, hf_model, prompt_ids
) -> None:
    eos = set(ours.eos_token_ids)
    full = 0
    got = greedy_generate(
        ours.model, get_backend("torch"), prompt_ids, NEW_TOKENS, dtype=torch.float32
    )
    for prompt, text, mine in zip(prompt_ids, PROMPTS, got, strict=True):
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
            )
        want = out[0, len(prompt) :].tolist()
        # HF stops at EOS; our loop does not, so compare up to and including the first EOS.
        stop = next((i + 1 for i, t in enumerate(mine) if t in eos), len(mine))
        assert mine[:stop] == want, f"prompt {text!r}"
        full += len(want) == NEW_TOKENS
    assert full >= 5, f"only {full} prompts compared over all {NEW_TOKENS} tokens"
